"""The store side of init: the keys ranks meet through, and the error key that makes one rank's
failed init fail init on every rank at once (instead of the others waiting out the timeout)."""
from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

from .state import session

ERROR_KEY = "init_error"
_POLL_S = 0.02  # how often a waiting rank looks for its key and for a peer's error


# the MASTER_ADDR/MASTER_PORT store of this process, made at its first init and kept for the
# later ones (issue 28 item 10): a store per init made rank 0 start and stop a TCP store server
# on the same port at every cycle, and a peer still talking to the old server failed its init
# ("Did the remote server shutdown?"). Keys carry the init's generation, so they never clash.
# (kept in session.env_stores; dropped before the interpreter tears down, while torch can still
# stop a server's thread)
atexit.register(session.env_stores.clear)


def env_store(rank: int, world: int, timeout: float):
    """The store built from MASTER_ADDR/MASTER_PORT (torchrun's agent store when present), one
    per process and address."""
    import torch.distributed as dist

    key = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], rank, world)
    if key not in session.env_stores:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world,
                                           timeout=timedelta(seconds=timeout)))
        session.env_stores[key] = store
    return session.env_stores[key]


class InitStore:
    """Wraps one init's (prefixed) store for the core's bootstrap callbacks."""

    def __init__(self, store, rank: int):
        self.store = store
        self.rank = rank

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def peer_failed(self):
        """The message a peer published when its init failed, or None."""
        if self.store.check([ERROR_KEY]):
            return self.store.get(ERROR_KEY).decode(errors="replace")
        return None

    def get(self, key: str, wait_s: float) -> bytes:
        """The value of `key` once a peer sets it; raises when a peer's init failed or after
        wait_s seconds."""
        deadline = time.monotonic() + wait_s
        while not self.store.check([key]):
            failed = self.peer_failed()
            if failed is not None:
                raise RuntimeError(f"init failed on another rank: {failed}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"key '{key}' was not set by a peer within {wait_s:.1f} s")
            time.sleep(_POLL_S)
        return self.store.get(key)

    def publish_failure(self, exc: BaseException) -> None:
        """Tells the peers this rank's init failed (best effort: the store may be the cause)."""
        try:
            if not self.store.check([ERROR_KEY]):
                self.store.set(ERROR_KEY, f"rank {self.rank}: {type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 (the original error is the one to raise)
            pass
