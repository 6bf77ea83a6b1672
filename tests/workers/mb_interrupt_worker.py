"""run_concurrent interrupted (a SIGINT rank 0 sends itself: KeyboardInterrupt) while its
micro-batch threads wait in all-reduces that rank 1 never joins (2 ranks, 2 micro-batches):
rank 0's call ends with the KeyboardInterrupt once its threads have left fn, and rank 1, waiting
in a barrier, fails naming the interrupt (both at once, not at the collective timeout: before
the abort, rank 1 failed with a timeout error and rank 0's call ended only then).
With "model" as argument the call sums a model's gradients: the main thread waits in the
reducer for a bucket the hung micro-batches never fill (it looks for the interrupt while it
waits; before, it saw it only once the threads timed out).
With "reducer_sum": the micro-batches run a model's backward and end; rank 1 never joins the
reducer's own gradient sum (csrc/python/py_sync.c), and the interrupt comes while the reducer waits
in it (before, it was seen only when that sum timed out, and rank 1 failed with a timeout)."""
import os
import signal
import sys
import tempfile
import threading
import time

import torch

import axonn_c


def _interrupt_when(entered: threading.Barrier) -> None:
    entered.wait()
    time.sleep(0.2)  # (the threads' all-reduces wait; sooner, they fail as they start: the same)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _flag():
    """rank 0's call has ended (a file: rank 1 waits for it without a collective)"""
    port = os.environ["MASTER_PORT"]
    return os.path.join(tempfile.gettempdir(), f"axonn_c_mb_interrupt_{port}")


def _run_interrupted(fn, model):
    try:
        axonn_c.run_concurrent(fn, torch.ones(4, 2), model=model)
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("run_concurrent ran to its end through the interrupt")


def _barrier_fails():
    try:
        axonn_c.comm.barrier()
    except Exception as e:
        assert "run_concurrent was interrupted" in str(e), e
    else:
        raise AssertionError("a collective after the aborted call passed")


def interrupt_the_reducer_sum():
    model, left = torch.nn.Linear(2, 2), []

    def fn(x):
        model(x).sum().backward()
        left.append(x)

    def interrupt_when_summing():
        while len(left) < 2:  # (both micro-batches ended: the reducer is in its sum)
            time.sleep(0.01)
        time.sleep(0.2)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=interrupt_when_summing, daemon=True).start()
    _run_interrupted(fn, model)
    _barrier_fails()


def main():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    g = axonn_c.init(G_data=2, concurrent_microbatches=2, timeout=60)
    if g.rank == 1 and "reducer_sum" in sys.argv[1:]:
        # (no collective on channel 0 until rank 0 aborted: one on another group there would
        # fail both ranks at once, as out of step)
        deadline = time.monotonic() + 300
        while not os.path.exists(_flag()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.path.exists(_flag()):
            os.unlink(_flag())
    if g.rank == 1:
        try:
            axonn_c.comm.barrier()
        except Exception as e:  # (rank 0 never enters it)
            assert "run_concurrent was interrupted (KeyboardInterrupt) on rank 0" in str(e), e
        else:
            raise AssertionError("rank 1's barrier passed without rank 0")
    elif "reducer_sum" in sys.argv[1:]:
        try:
            interrupt_the_reducer_sum()
        finally:  # (rank 1 goes on also when this failed)
            open(_flag(), "w").close()
    else:
        entered, left = threading.Barrier(3), []

        def fn(x):
            entered.wait()
            try:
                axonn_c.comm.all_reduce(x)  # rank 1 never joins it
            finally:
                left.append(x)
            return x

        threading.Thread(target=_interrupt_when, args=(entered,), daemon=True).start()
        model = torch.nn.Linear(2, 2) if "model" in sys.argv[1:] else None
        _run_interrupted(fn, model)
        # (on Python 3.11 a Thread.join interrupted while the thread runs takes it for ended)
        assert len(left) == 2, f"the call ended while {2 - len(left)} micro-batch(es) ran fn"
        _barrier_fails()
    axonn_c.finalize()
    print(f"rank {g.rank}: interrupt ok", flush=True)


if __name__ == "__main__":
    main()
