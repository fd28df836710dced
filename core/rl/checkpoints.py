"""Training checkpoints: a folder a person can open, safetensors and JSON, never pickle.

:func:`save_checkpoint` writes one atomically (the trainer calls it every
``checkpoint_every`` updates and at the end); :func:`load_agent`,
:func:`load_optimizer_state`, :func:`load_trainer_state` and :func:`load_rng_state` read
its parts back, which is how a run resumes exactly where it stopped.

Example::

    >>> folder = save_checkpoint(run_dir / "000010", agent, opt, {"update": 10}, {"generator": g})  # doctest: +SKIP
    >>> load_agent(folder).n_actions == agent.n_actions                                            # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from core.base.errors import InputError
from core.rl.agent import Agent
from core.state.features import load_encoder, save_encoder

#: Version of the checkpoint layout (``agent.json`` and ``trainer.json`` carry it).
CHECKPOINT_VERSION = 1


def save_checkpoint(folder: Path, agent: Agent, optimizer: torch.optim.Optimizer, trainer: Mapping[str, Any],
                    generators: Mapping[str, torch.Generator]) -> Path:
    """Write a checkpoint folder atomically: ``agent.safetensors`` + ``agent.json`` (actor and
    critics), ``encoder.safetensors`` + ``encoder.json``, ``optimizer.safetensors`` +
    ``optimizer.json`` (Adam moments as tensors, the rest as JSON), ``trainer.json``
    (update, env steps, β, curriculum …) and ``rng.safetensors``.  No pickle."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    policy = {k: v.detach().cpu().contiguous() for k, v in agent.state_dict().items()
              if not k.startswith("encoder.")}
    save_file(policy, str(tmp / "agent.safetensors"))
    (tmp / "agent.json").write_text(json.dumps({"version": CHECKPOINT_VERSION, **agent.architecture()}, indent=2))
    save_encoder(agent.encoder, tmp, "encoder")
    opt_state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, st in opt_state["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{pid}.{key}"] = val.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = val
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps({"param_groups": opt_state["param_groups"],
                                                    "scalars": scalars}, indent=2))
    save_file({**{k: g.get_state().cpu() for k, g in generators.items()}, "torch_cpu": torch.get_rng_state()},
              str(tmp / "rng.safetensors"))
    (tmp / "trainer.json").write_text(json.dumps(dict(trainer), indent=2, default=float))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def load_agent(folder: str | Path, device: str | torch.device = "cpu") -> Agent:
    """The agent (encoder, actor, critics) of a checkpoint folder."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta_path = folder / "agent.json"
    if not meta_path.is_file():
        raise InputError(f"no checkpoint in {folder} (agent.json missing)", file=str(folder))
    meta = json.loads(meta_path.read_text())
    encoder = load_encoder(folder, "encoder", device="cpu")
    agent = Agent(int(meta["n_actions"]), encoder.config, hidden=int(meta["hidden"]),
                  n_critics=int(meta["n_critics"]))
    agent.encoder.load_state_dict(encoder.state_dict())
    missing, unexpected = agent.load_state_dict(load_file(str(folder / "agent.safetensors")), strict=False)
    missing = [k for k in missing if not k.startswith("encoder.")]
    if missing or unexpected:
        raise InputError(f"checkpoint {folder} does not fit the policy (missing {missing}, unexpected "
                         f"{unexpected})", file=str(folder))
    return agent.to(device)


def load_optimizer_state(folder: Path, optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Restore the optimizer state :func:`save_checkpoint` wrote."""
    from safetensors.torch import load_file

    meta = json.loads((folder / "optimizer.json").read_text())
    tensors = load_file(str(folder / "optimizer.safetensors"), device=str(device))
    state: dict[int, dict[str, Any]] = {}
    for key, val in tensors.items():
        pid, name = key.split(".", 1)
        # Adam keeps `step` on the CPU unless capturable/fused
        state.setdefault(int(pid), {})[name] = val.cpu() if name == "step" else val
    for pid, sc in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(sc)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})



def load_trainer_state(folder: str | Path) -> dict[str, Any]:
    """``trainer.json`` of a checkpoint: update, env steps, β, curriculum, review items, warm start."""
    trainer: dict[str, Any] = json.loads((Path(folder) / "trainer.json").read_text())
    return trainer


def load_rng_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The random generators' states of a checkpoint, by the names :func:`save_checkpoint`
    was given, plus ``torch_cpu`` (torch's global CPU generator)."""
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "rng.safetensors"))


__all__ = ["CHECKPOINT_VERSION", "load_agent", "load_optimizer_state", "load_rng_state", "load_trainer_state",
           "save_checkpoint"]
