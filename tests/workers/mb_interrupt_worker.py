"""run_concurrent interrupted (a SIGINT rank 0 sends itself: KeyboardInterrupt) while its
micro-batch threads wait in all-reduces that rank 1 never joins (2 ranks, 2 micro-batches):
rank 0's call ends with the KeyboardInterrupt once its threads have left fn, and rank 1, waiting
in a barrier, fails naming the interrupt (both at once, not at the collective timeout: before
the abort, rank 1 failed with a timeout error and rank 0's call ended only then).
With "model" as argument the call sums a model's gradients: the main thread waits in the
reducer for a bucket the hung micro-batches never fill (it looks for the interrupt while it
waits; before, it saw it only once the threads timed out)."""
import signal
import sys
import threading
import time

import torch

import axonn_c


def _interrupt_when(entered: threading.Barrier) -> None:
    entered.wait()
    time.sleep(0.2)  # (the threads' all-reduces wait; sooner, they fail as they start: the same)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def main():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    g = axonn_c.init(G_data=2, concurrent_microbatches=2, timeout=60)
    if g.rank == 1:
        try:
            axonn_c.comm.barrier()
        except Exception as e:  # (rank 0 never enters it)
            assert "run_concurrent was interrupted (KeyboardInterrupt) on rank 0" in str(e), e
        else:
            raise AssertionError("rank 1's barrier passed without rank 0")
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
        try:
            axonn_c.run_concurrent(fn, torch.ones(4, 2), model=model)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("run_concurrent ran to its end through the interrupt")
        # (on Python 3.11 a Thread.join interrupted while the thread runs takes it for ended)
        assert len(left) == 2, f"the call ended while {2 - len(left)} micro-batch(es) ran fn"
        try:
            axonn_c.comm.barrier()
        except Exception as e:
            assert "run_concurrent was interrupted" in str(e), e
        else:
            raise AssertionError("a collective after the aborted call passed")
    axonn_c.finalize()
    print(f"rank {g.rank}: interrupt ok", flush=True)


if __name__ == "__main__":
    main()
