"""Architecture registry: `general.architecture` -> the worker module that serves it.

Draft architectures (role "draft": `dflash`, `qwen35-dflash-draft`) are served by `daemons.dflash`,
which validates their files (`check_file`); they are loaded next to a target
(`daemons.dflash.DFlashDraft.load(path, target)`), never alone.

The router dispatches a model to a worker by this table; `dflashd inspect` uses it to say what serves
a file. An architecture whose `worker` is None is recognised (we can inspect and describe its files)
but no worker serves it yet; `worker_module` says so with a clear error.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from daemons.gguf_reader import GGUFError, GGUFFile, UnknownArchitectureError


@dataclass(frozen=True)
class Architecture:
    name: str
    description: str
    worker: str | None  # dotted module path of the model/worker implementation, None if not served yet
    role: str = "target"  # "target" or "draft"


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("qwen35", "Qwen3.5/3.6 dense: Gated DeltaNet + gated full attention", "daemons.qwen35"),
    Architecture("qwen35moe", "Qwen3.5/3.6 MoE: Gated DeltaNet + gated attention + experts", None),
    Architecture("laguna", "Laguna MoE with sliding-window attention", None),
    Architecture("qwen3", "Qwen3 dense transformer", None),
    Architecture("dflash", "DFlash block-diffusion draft (llama.cpp layout)", "daemons.dflash", role="draft"),
    Architecture("qwen35-dflash-draft", "DFlash draft for qwen35 (Luce layout)", "daemons.dflash", role="draft"),
)}


class ArchitectureNotServedError(GGUFError):
    """The architecture is known but no dflashd worker serves it yet."""


def lookup(gguf: GGUFFile) -> Architecture:
    name = gguf.architecture
    arch = ARCHITECTURES.get(name)
    if arch is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnknownArchitectureError(gguf.path, f"unknown architecture '{name}' (known: {known})")
    return arch


def load_model(path: str, device: str = "cpu"):
    """Open `path`, find its architecture's module and load the model on `device`.
    The module provides `Model.load(path, backend)` (e.g. `daemons.qwen35.Qwen35Model`)."""
    from kernels import get_backend
    with GGUFFile(path) as g:
        module = worker_module(g)
        arch = lookup(g)
    if arch.role == "draft":
        # a draft shares its target's embeddings and head: it is loaded next to one (`--draft`)
        raise ArchitectureNotServedError(path, f"'{arch.name}' is a draft model; load it with its target "
                                               f"(generate --model TARGET --draft {path})")
    backend = get_backend(device)
    return module.Model.load(path, backend)


def worker_module(gguf: GGUFFile) -> ModuleType:
    """The module that implements the file's architecture (it provides `check_file(gguf)`)."""
    arch = lookup(gguf)
    if arch.worker is None:
        raise ArchitectureNotServedError(gguf.path, f"architecture '{arch.name}' ({arch.description}) "
                                                    f"is recognised but no dflashd worker serves it yet")
    return importlib.import_module(arch.worker)
