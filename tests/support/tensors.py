"""State dicts made up for the tests, their exact comparison, and
checkpoint formats written by hand."""

from __future__ import annotations

from typing import Any

import torch

MiB = 1 << 20


def state_dict(seed: int, layers: int = 8, numel: int = 192 * 1024) -> dict[str, torch.Tensor]:
    """Random float32 weights, the same for the same arguments: per layer one
    of ``numel`` elements and a small norm beside it, as a model has."""
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(layers):
        sd[f"layer{i}.weight"] = torch.randn(numel, generator=gen)
        sd[f"layer{i}.norm"] = torch.randn(64, generator=gen)
    return sd


def state_dict_of(total_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``state_dict`` of about ``total_bytes``: weights of 4 MiB from 64 MiB
    on (a large model's), of 64 KiB below."""
    numel = MiB if total_bytes >= 64 * MiB else 16 * 1024
    return state_dict(seed, layers=max(1, total_bytes // (4 * numel)), numel=numel)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts / lists / tuples to ``{"a.b.0": leaf}``."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}."))
        return out or {prefix.rstrip("."): type(obj)()}
    return {prefix.rstrip("."): obj}


def assert_same(expected: Any, got: Any, what: str = "state") -> None:
    """Same keys, and every tensor torch.equal (same dtype and shape)."""
    exp, act = flatten(expected), flatten(got)
    assert exp.keys() == act.keys(), (
        f"{what}: keys differ: missing {sorted(exp.keys() - act.keys())[:10]}, "
        f"unexpected {sorted(act.keys() - exp.keys())[:10]}"
    )
    for k, e in exp.items():
        a = act[k]
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{what}: {k} is {type(a).__name__}, not a tensor"
            assert (e.dtype, e.shape) == (a.dtype, a.shape), (
                f"{what}: {k}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
            )
            assert torch.equal(e, a), f"{what}: {k}: values differ"
        else:
            assert e == a, f"{what}: {k}: {a!r} != {e!r}"
