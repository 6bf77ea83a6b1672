"""axonn_c.checkpoint: save on one grid, load on others and on other world sizes (separate
torchrun jobs), continue training: the losses equal the uninterrupted run's (bitwise on the same
grid, to float32 rounding elsewhere), optimizer state and `extra` included; an asynchronous save
gives the same checkpoint; broken checkpoints raise on every rank; a rank killed during a save
leaves the previous checkpoint loadable; the offline info/export tools."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, WORKERS, assert_no_shm_leftovers, free_port, job_tag, torchrun

SAVE_GRID = ("3", "1,1,1,3")  # depth 3: shards of 1 to 3 boxes of the full weights


def losses(out):
    # (searched anywhere: the ranks' lines may run into each other in the shared output)
    pairs = re.findall(r"LOSS (\d+) (-?0x[0-9a-f.]+p[+-]\d+)", out)
    found = {int(i): float.fromhex(v) for i, v in pairs}
    assert sorted(found) == [3, 4, 5], out
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One save job: (directory, its output)."""
    d = tmp_path_factory.mktemp("ckpt")
    out = torchrun(int(SAVE_GRID[0]), "checkpoint_worker.py", "--mode", "save", "--grid",
                   SAVE_GRID[1], "--dir", d)
    assert "EXPORT MATCH" in out, out
    assert "MAX BOXES 3" in out, out  # the save grid does split rows over depth
    return d, out


@pytest.mark.multiproc
def test_same_grid_resumes_bitwise(saved):
    """(the asynchronous save's checkpoint exports bitwise equal to this one: the save job)"""
    d, ref = saved
    out = torchrun(int(SAVE_GRID[0]), "checkpoint_worker.py", "--mode", "resume", "--grid",
                   SAVE_GRID[1], "--dir", d)
    assert losses(out) == losses(ref)


@pytest.mark.multiproc
@pytest.mark.parametrize("world,grid", [(4, "1,2,2,1"), (2, "1,1,1,2"), (8, "2,1,2,2")])
def test_other_grid_and_world_resumes(saved, world, grid):
    d, ref = saved
    out = torchrun(world, "checkpoint_worker.py", "--mode", "resume", "--grid", grid,
                   "--dir", d)
    got, want = losses(out), losses(ref)
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=1e-5), (i, got, want)


@pytest.mark.multiproc
def test_broken_checkpoints_raise_on_every_rank(tmp_path):
    out = torchrun(2, "checkpoint_worker.py", "--mode", "errors", "--grid", "1,1,1,2",
                   "--dir", tmp_path)
    for case in ("missing", "truncated", "badmeta", "nofile", "foreign", "mismatch",
                 "unexpected", "userdata"):
        for rank in (0, 1):
            assert f"RAISED {case} rank {rank}" in out, (case, rank, out)
    assert "ERRORS DONE rank 0" in out and "ERRORS DONE rank 1" in out


@pytest.mark.multiproc
def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(WORKERS / "checkpoint_worker.py"), "--mode", "kill", "--grid", "1,1,1,2",
           "--dir", str(tmp_path)]
    tag = job_tag()
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", AXONN_C_SHM_TAG=tag,
               TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "SAVING AGAIN rank 1" in out and "UNREACHABLE" not in out, out
    assert "exitcode  : 17" in out, out  # rank 1 died where the worker made it
    assert_no_shm_leftovers(tag, "the killed save")
    assert (tmp_path / "ckpt.partial").is_dir()  # the unfinished save, never published
    again = torchrun(2, "checkpoint_worker.py", "--mode", "resume", "--grid", "1,1,1,2",
                     "--dir", tmp_path)
    assert losses(again) == losses(out)


def test_info_and_export_cli(saved, tmp_path):
    d, _ = saved
    run = dict(capture_output=True, text=True, timeout=300, cwd=tmp_path)
    info = subprocess.run([sys.executable, "-m", "axonn_c.checkpoint", "info", d / "ckpt"], **run)
    assert info.returncode == 0, info.stderr
    assert "saved on 3 ranks (G_data=1 G_intra_r=1 G_intra_c=1 G_intra_d=3)" in info.stdout
    assert re.search(r"model\.blocks\.0\.attn\.qkv\.weight +\[30, 10\] +float32", info.stdout)
    out = tmp_path / "serial.pt"
    exp = subprocess.run([sys.executable, "-m", "axonn_c.checkpoint", "export", d / "ckpt", out],
                         **run)
    assert exp.returncode == 0, exp.stderr
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from gpt import GPT, GPTConfig
    finally:
        sys.path.pop(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=10))
    model.load_state_dict(torch.load(out), strict=True)  # the plain serial model takes it
    bad = subprocess.run([sys.executable, "-m", "axonn_c.checkpoint", "info", tmp_path / "no"],
                         **run)
    assert bad.returncode == 1 and "no checkpoint at" in bad.stderr


def test_world_of_one_sgd_momentum_extra_and_async(world_of_one, tmp_path):
    import axonn_c
    import axonn_c.checkpoint as ckpt

    assert axonn_c.checkpoint is ckpt  # (the package attribute, imported on first use)
    axonn_c.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(axonn_c.Linear(6, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    extra = {"step": 7, "rng": torch.get_rng_state(), "pos": [1, 2]}
    handle = ckpt.save(tmp_path / "c", model, opt, extra=extra, async_save=True)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with torch.no_grad():  # the staged copy was taken at save(): later changes are not saved
        for p in model.parameters():
            p.add_(1.0)
    assert handle.wait() == str(tmp_path / "c") and handle.done()
    model2 = torch.nn.Sequential(axonn_c.Linear(6, 4), torch.nn.LayerNorm(4))
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.5, momentum=0.9)
    got = ckpt.load(tmp_path / "c", model2, opt2)
    assert got["step"] == 7 and got["pos"] == [1, 2] and torch.equal(got["rng"], extra["rng"])
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k
    for p, m in zip(model2.parameters(), momentum):
        assert torch.equal(opt2.state[p]["momentum_buffer"], m)
    assert opt2.param_groups[0]["lr"] == 0.1  # the saved hyperparameters
    assert ckpt.read_info(tmp_path / "c")["optimizer"] == "SGD"
    # saving again over it replaces it (and no temporary directory is left, beside or inside)
    ckpt.save(str(tmp_path / "c") + os.sep, model2, extra={"step": 8})
    assert ckpt.load(tmp_path / "c", model2)["step"] == 8
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.distcp"]
    with pytest.raises(ckpt.CheckpointError, match="holds no optimizer state"):
        ckpt.load(tmp_path / "c", model2, opt2)


@pytest.mark.multiproc
def test_train_gpt_example_saves_and_resumes_on_another_grid(tmp_path):
    small = ["--n-layer", "1", "--n-embd", "16", "--block-size", "8", "--sample-chars", "0",
             "--log-every", "1", "--batch-size", "4"]
    d = tmp_path / "gpt"
    out = torchrun(2, ROOT / "examples" / "train_gpt.py", "--steps", "4", "--save-every", "2",
                   "--save", d, *small)
    assert f"saved {d} at step 4" in out and "done: 4 steps" in out, out
    out = torchrun(2, ROOT / "examples" / "train_gpt.py", "--steps", "6", "--resume", d,
                   "--G-intra-d", "2", *small)
    assert f"resumed from {d} at step 4" in out and "done: 2 steps" in out, out
    assert re.search(r"step +5 +loss [0-9.]+", out), out


@pytest.mark.multiproc
def test_bench_checkpoint_runs():
    out = torchrun(2, ROOT / "benchmarks" / "bench_checkpoint.py", "--grid", "1,1,1,2",
                   "--mb", "0.2", "--width", "128", "--repeats", "1", "--optimizer")
    for row in ("axonn_c save", "axonn_c load", "naive save", "naive load"):
        assert re.search(rf"{row} +[0-9.]+ ms +[0-9.]+ GB/s", out), out


@pytest.mark.multiproc
def test_transformers_llama_export_gives_the_serial_logits(tmp_path):
    pytest.importorskip("transformers")
    out = torchrun(4, "checkpoint_llama_worker.py", tmp_path / "llama")
    assert "LLAMA LOGITS MATCH" in out, out


def test_world_of_one_async_save_not_waited_before_finalize(world_of_one, tmp_path):
    import axonn_c
    import axonn_c.checkpoint as ckpt

    axonn_c.init()
    model = torch.nn.Sequential(axonn_c.Linear(4, 4))
    handle = ckpt.save(tmp_path / "a", model, async_save=True)
    axonn_c.finalize()
    axonn_c.init()
    with pytest.warns(RuntimeWarning, match="was not published: finalize"):
        ckpt.save(tmp_path / "b", model)  # drops the stale save, saves this one
    assert handle.failed() and not handle.done() and not (tmp_path / "a").exists()
    assert ckpt.load(tmp_path / "b", model) is None
    handle2 = ckpt.save(tmp_path / "c", model, async_save=True)
    axonn_c.finalize()
    axonn_c.init()
    with pytest.raises(ckpt.CheckpointError, match="was not published"):
        handle2.wait()
    assert not (tmp_path / "c").exists()


@pytest.mark.multiproc
def test_embedding_and_split_norms_reshard(tmp_path):
    # saved on col x depth (the tables' depth shards cut rows), loaded on row x col and on
    # another world size: the full tensors and the optimizer state come back bitwise
    torchrun(4, "checkpoint_layers_worker.py", "--mode", "save", "--grid", "1,1,2,2",
             "--dir", tmp_path)
    for world, grid in ((4, "1,2,2,1"), (2, "1,2,1,1"), (8, "2,1,2,2")):
        out = torchrun(world, "checkpoint_layers_worker.py", "--mode", "load", "--grid", grid,
                       "--dir", tmp_path)
        assert f"layers load on {grid} ok" in out


_KILL_IN_RENAME_WINDOW = r'''
import os, sys, torch, axonn_c, axonn_c.checkpoint as ckpt
d = sys.argv[1]
axonn_c.init()
torch.manual_seed(0)
model = torch.nn.Sequential(axonn_c.Linear(6, 4), torch.nn.LayerNorm(4))
ckpt.save(os.path.join(d, "c"), model, extra={"step": 1})
real_rename = os.rename
def rename(src, dst):
    # the publishing rank dies after moving the previous checkpoint aside, before the new one
    # takes its place: the window a kill can hit between the two renames
    if str(src).endswith(".partial") and os.path.isdir(os.path.join(d, "c.old")):
        os._exit(17)
    real_rename(src, dst)
ckpt.os.rename = rename
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
ckpt.save(os.path.join(d, "c"), model, extra={"step": 2})
print("UNREACHABLE")
'''


@pytest.mark.multiproc
def test_kill_between_publish_renames_keeps_previous_checkpoint(world_of_one, tmp_path):
    """A save killed between its two renames (the previous checkpoint moved to PATH.old, the new
    one not yet renamed to PATH) leaves the previous checkpoint complete at PATH.old; load(PATH)
    says where it is; the next save to PATH publishes normally and removes both leftovers."""
    env = dict(os.environ, AXONN_C_SHM_TAG=job_tag(), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _KILL_IN_RENAME_WINDOW, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 17 and "UNREACHABLE" not in proc.stdout, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["c.old", "c.partial"]

    import axonn_c
    import axonn_c.checkpoint as ckpt

    axonn_c.init()
    torch.manual_seed(0)  # the same initial weights as the first, published save
    want = torch.nn.Sequential(axonn_c.Linear(6, 4), torch.nn.LayerNorm(4))
    model = torch.nn.Sequential(axonn_c.Linear(6, 4), torch.nn.LayerNorm(4))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with pytest.raises(ckpt.CheckpointError, match=r"previous checkpoint is .*c\.old"):
        ckpt.load(tmp_path / "c", model)
    assert ckpt.load(str(tmp_path / "c") + ".old", model)["step"] == 1
    for (k, v), w in zip(model.state_dict().items(), want.state_dict().values()):
        assert torch.equal(v, w), k
    ckpt.save(tmp_path / "c", model, extra={"step": 3})
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert ckpt.load(tmp_path / "c", model)["step"] == 3


class _Counted(torch.nn.Module):
    """Extra state as many modules keep it: a fresh tensor, and a plain object."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.n, self.meta = 0, {}

    def get_extra_state(self):
        return torch.tensor(self.n)

    def set_extra_state(self, state):
        self.n = int(state)


class _Tagged(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.meta = {}

    def get_extra_state(self):
        return {"meta": dict(self.meta)}

    def set_extra_state(self, state):
        self.meta = dict(state["meta"])


def test_world_of_one_extra_states_are_set(world_of_one, tmp_path):
    """A module's extra state comes back through its set_extra_state, as load_state_dict
    gives it: a tensor made for the state dict alone, and a value that is not a tensor."""
    import axonn_c
    import axonn_c.checkpoint as ckpt

    axonn_c.init()
    model = torch.nn.Sequential(_Counted(), _Tagged(), axonn_c.Linear(2, 2))
    model[0].n, model[1].meta = 5, {"tokens": 123}
    ckpt.save(tmp_path / "c", model)
    fresh = torch.nn.Sequential(_Counted(), _Tagged(), axonn_c.Linear(2, 2))
    ckpt.load(tmp_path / "c", fresh)
    assert fresh[0].n == 5 and fresh[1].meta == {"tokens": 123}
    serial = ckpt.export(tmp_path / "c")  # (the serial state dict: extra states included)
    assert serial["1._extra_state"] == {"meta": {"tokens": 123}}
    assert int(serial["0._extra_state"]) == 5
    for (k, v), w in zip(fresh.state_dict().items(), model.state_dict().values()):
        if torch.is_tensor(v):
            assert torch.equal(v, w), k
    # a model whose extra state is a tensor where the checkpoint holds an object: refused
    other = torch.nn.Sequential(_Counted(), _Counted(), axonn_c.Linear(2, 2))
    with pytest.raises(ckpt.CheckpointError, match=r"1\._extra_state: not a tensor"):
        ckpt.load(tmp_path / "c", other)


def test_world_of_one_failed_saves_leave_no_partial_directory(world_of_one, tmp_path):
    import axonn_c
    import axonn_c.checkpoint as ckpt
    from torch.distributed.checkpoint import FileSystemWriter

    axonn_c.init()
    model = torch.nn.Sequential(axonn_c.Linear(3, 3))
    ckpt.save(tmp_path / "c", model, extra={"step": 1})
    with pytest.raises(ckpt.CheckpointError, match=r"\(planning\) failed.*pickle"):
        ckpt.save(tmp_path / "c", model, extra={"fn": lambda: 0})  # (not picklable)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    # an asynchronous save whose writes fail: wait() raises (again when called again), the
    # handle is not done, the directory goes, the previous checkpoint stays
    real = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        raise OSError(28, "No space left on device")
    FileSystemWriter.write_data = full_disk
    try:  # (until the writing thread is joined: it looks the method up when it runs)
        handle = ckpt.save(tmp_path / "c", model, extra={"step": 2}, async_save=True)
        for _ in range(2):
            with pytest.raises(ckpt.CheckpointError, match="No space left on device"):
                handle.wait()
    finally:
        FileSystemWriter.write_data = real
    assert handle.failed() and not handle.done() and not handle.stale()
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert ckpt.load(tmp_path / "c", model) == {"step": 1}


def test_world_of_one_save_to_a_link_replaces_the_link(world_of_one, tmp_path):
    import axonn_c
    import axonn_c.checkpoint as ckpt

    axonn_c.init()
    model = torch.nn.Sequential(axonn_c.Linear(3, 3))
    ckpt.save(tmp_path / "step_1", model, extra={"step": 1})
    os.symlink("step_1", tmp_path / "latest")
    for step in (2, 3):
        ckpt.save(tmp_path / "latest", model, extra={"step": step})
        assert not os.path.islink(tmp_path / "latest")
        assert sorted(os.listdir(tmp_path)) == ["latest", "step_1"]
        assert ckpt.load(tmp_path / "latest", model) == {"step": step}
    assert ckpt.load(tmp_path / "step_1", model) == {"step": 1}  # (what it pointed to: kept)


def test_world_of_one_other_optimizer_class_and_export_path_refused(world_of_one, tmp_path):
    import axonn_c
    import axonn_c.checkpoint as ckpt

    axonn_c.init()
    model = torch.nn.Sequential(axonn_c.Linear(3, 3))
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    adam.step()
    ckpt.save(tmp_path / "c", model, adam)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ckpt.CheckpointError, match="class Adam, .* lacks this SGD's "
                                                   "hyperparameters .*momentum"):
        ckpt.load(tmp_path / "c", model, sgd)
    adamw = torch.optim.AdamW(model.parameters())  # (the same hyperparameters: loads)
    ckpt.load(tmp_path / "c", model, adamw)
    bad = subprocess.run([sys.executable, "-m", "axonn_c.checkpoint", "export", tmp_path / "c",
                          tmp_path / "no" / "such" / "out.pt"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert bad.returncode == 1 and bad.stderr.startswith("error:"), bad.stderr


@pytest.mark.multiproc
def test_buffers_saved_as_rank_0_holds_them(tmp_path):
    out = torchrun(2, "checkpoint_buffers_worker.py", tmp_path)
    assert "buffers as rank 0 holds them" in out
