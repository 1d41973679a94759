"""One run split over processes gives the single-process run's samples."""

import subprocess
import sys
import textwrap

import pytest
import torch

from smp_core.distributed import gather_results, shard
from smp_core.models import toy_mlp
from smp_core.recursion import run_smp


def test_shards_cover_every_chain_once():
    for n, world in [(10, 3), (7, 7), (100, 8), (5, 1)]:
        bounds = [shard(n, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
        assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1
    with pytest.raises(ValueError, match="world_size: 4 processes for 3 chains"):
        shard(3, 4, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        shard(10, 2, 2)


def _problem():
    torch.manual_seed(0)
    net = toy_mlp().double()
    x = torch.rand(60, 2, dtype=torch.float64) * 2 - 1
    return net, x


KW = dict(n_steps=60, seed=11, progress=False, options={"check_every": 20})


@pytest.mark.parametrize("preconditioner, tau, exact", [("none", 1.0, True), ("ema-diag", 0.3, True),
                                                        ("fixed-dense", 0.1, False)])
def test_gathered_shards_are_the_single_run(preconditioner, tau, exact):
    net, x = _problem()
    whole = run_smp(net, "bernoulli", x, n_chains=7, preconditioner=preconditioner, tau=tau, **KW)
    parts = [run_smp(net, "bernoulli", x, n_chains=hi - lo, preconditioner=preconditioner, tau=tau,
                     **{**KW, "options": {**KW["options"], "first_chain": lo}}) for lo, hi in (shard(7, 3, r)
                                                                                        for r in range(3))]
    merged = gather_results(parts)
    # dense: to rounding, measured against the entries' scale (MKL's batched kernels round by the batch's size)
    compare = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=0, atol=1e-10 * float(b.abs().max())))
    assert compare(merged.theta, whole.theta) and torch.equal(merged.diverged, whole.diverged)
    for a, b in zip((*merged.precond_state.stat, *merged.precond_state.factor),
                    (*whole.precond_state.stat, *whole.precond_state.factor), strict=True):
        assert a.shape == b.shape and compare(a, b)
    assert merged.config["n_chains"] == 7 and merged.config["ranks"] == 3


# argv: where rank 0 saves the samples, then optionally K (default 60) and a checkpoint path
SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from smp_core.distributed import run_smp_sharded
    from smp_core.models import toy_mlp
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = toy_mlp().double()
    x = torch.rand(60, 2, dtype=torch.float64) * 2 - 1
    n_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    options = {"check_every": 10}
    if len(sys.argv) > 3:
        options.update(checkpoint=sys.argv[3], checkpoint_every=10)
    result = run_smp_sharded(net, "bernoulli", x, n_chains=7, preconditioner="ema-diag", tau=0.3,
                             n_steps=n_steps, seed=11, progress=False, options=options)
    if dist.get_rank() == 0:
        torch.save(result.theta, sys.argv[1])
    dist.destroy_process_group()
""")


def test_torchrun_with_two_processes_gives_the_single_run(tmp_path):
    script, out = tmp_path / "run.py", tmp_path / "theta.pt"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    net, x = _problem()
    whole = run_smp(net, "bernoulli", x, n_chains=7, preconditioner="ema-diag", tau=0.3, **KW)
    assert torch.equal(torch.load(out), whole.theta)


def test_each_rank_checkpoints_and_resumes_its_own_chains(tmp_path):
    """A sharded run stopped at K = 30 and resumed to K = 60 gives the single run's samples; each rank
    reads back its own file (a change to one rank's file moves that rank's chains only), and a rank without
    its file starts again from step 0 with the same chains. Three launches: each takes seconds of start-up."""
    script, out, ckpt = tmp_path / "run.py", tmp_path / "theta.pt", tmp_path / "run.ckpt"
    script.write_text(SCRIPT)

    def torchrun(n_steps):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(script), str(out), str(n_steps), str(ckpt)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(out)

    net, x = _problem()
    kw = dict(n_chains=7, preconditioner="ema-diag", tau=0.3, seed=11, progress=False, options={"check_every": 10})
    assert torch.equal(torchrun(30), run_smp(net, "bernoulli", x, n_steps=30, **kw).theta)
    files = [tmp_path / f"run.ckpt.rank{r}-of-2" for r in range(2)]
    at_30 = [torch.load(f, weights_only=False) for f in files]
    assert [p["step"] for p in at_30] == [30, 30]
    whole = run_smp(net, "bernoulli", x, n_steps=60, **kw).theta
    lo, hi = shard(7, 2, 1)
    # rank 0 resumes from its file as written; rank 1's file moved: only rank 1's chains move
    torch.save(at_30[0], files[0])
    torch.save({**at_30[1], "theta": at_30[1]["theta"] + 1e-3}, files[1])
    theta = torchrun(60)
    assert torch.equal(theta[:lo], whole[:lo]) and not torch.equal(theta[lo:hi], whole[lo:hi])
    assert [torch.load(f, weights_only=False)["step"] for f in files] == [60, 60]
    # rank 1 resumes from its file as written; rank 0 has none and starts again from step 0: the single run
    files[0].unlink()
    torch.save(at_30[1], files[1])
    assert torch.equal(torchrun(60), whole)
