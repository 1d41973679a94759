"""Bitwise check for a refactor of smp_core: every variant on three small networks, float32 and float64,
the element-wise path on and off, and five settings beyond the defaults (107 runs of 30 steps, 5 chains).

    python tools/bitwise_check.py capture before.pt   # at the old revision
    python tools/bitwise_check.py capture after.pt    # at the new one
    python tools/bitwise_check.py compare before.pt after.pt

Both captures on the same machine: rounding differs between CPUs.
"""

import dataclasses
import sys

import torch
from torch import nn

import smp_core
from smp_core.preconditioners import ema, fixed

VARIANTS = ["none"] + [f"{s}-{t}" for s in ("fixed", "ema", "periodic") for t in ("diag", "block", "dense", "kfac")]


def _mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 1))


def _gelu():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.GELU(), nn.Linear(5, 1))


def _cnn():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(72, 3))


def _run(net, lik, x, precond):
    r = smp_core.run_smp(net, lik, x, preconditioner=precond, tau=0.5, n_steps=30, n_chains=5, seed=4,
                         progress=False, options={"trace_every": 10})
    return r.samples(), r.precond_state


def capture(path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, xc = torch.randn(120, 3), torch.randn(60, 1, 8, 8)
    out = {}
    for mname, make, data, lik in (("mlp", _mlp, x, "bernoulli"), ("gelu", _gelu, x, "bernoulli"),
                                   ("cnn", _cnn, xc, "categorical")):
        for dtype in (torch.float32, torch.float64):
            for v in VARIANTS:
                p = smp_core.preconditioner_from_name(v, period=7) if v.startswith("periodic") else \
                    smp_core.preconditioner_from_name(v)
                for plain in (False, True) if v == "none" or v.endswith("diag") else (False,):
                    q = dataclasses.replace(p, elementwise_step=False) if plain else p
                    try:
                        out[(mname, str(dtype), v, plain)] = _run(make().to(dtype), lik, data.to(dtype), q)
                    except ValueError as error:  # kfac on a LayerNorm: refused, and the message is compared
                        out[(mname, str(dtype), v, plain)] = repr(error)
    extra = {"ema-dense-r3": ema("dense", refresh=3), "ema-kfac-r2": ema("kfac", refresh=2),
             "fixed-block-f64": fixed("block", statistic_dtype=torch.float64),
             "ema-block-id": ema("block", init="identity"), "ema-diag-id": ema("diag", init="identity")}
    for name, p in extra.items():
        out[("cnn-extra", name)] = _run(_cnn(), "categorical", xc, p)
    torch.save(out, path)
    print(f"{len(out)} runs saved to {path}")


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b, strict=True))
    return a == b


def compare(before, after):
    a, b = torch.load(before, weights_only=False), torch.load(after, weights_only=False)
    if a.keys() != b.keys():
        sys.exit("the two captures hold other runs")
    differ = [k for k in a if not _equal(a[k], b[k])]
    for k in differ:
        print("differs:", k)
    print(f"{len(a)} runs compared, {len(differ)} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["capture"] and len(sys.argv) == 3:
        capture(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
