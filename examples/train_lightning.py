"""Train a small byte-level transformer with Lightning and dynamiq: DDP with the comm hook,
and FSDP2 (``ModelParallelStrategy``) with the compressed reduce-scatter.

CPU, 2 processes, gloo:
    torchrun --nproc-per-node 2 examples/train_lightning.py --strategy ddp fsdp --steps 20

Needs ``lightning`` (the ``lightning`` extra). Nothing is written outside ``--root`` (a
temporary directory by default): no loggers, checkpoints or progress bars.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

import dynamiq.fsdp
from dynamiq.bench.ddp_train import TrainConfig, _batch, doc_text
from dynamiq.data.model import build_model, lm_loss
from dynamiq.ddp import DynamiqState, dynamiq_hook

CFG = TrainConfig(d_model=64, n_layers=2, n_heads=4, seq_len=32, batch=8)


class DynamiqDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers ``ddp_comm_hook`` on every device: Lightning 2.6
    registers comm hooks only when the root device is CUDA, and silently drops them on the
    CPU (gloo). On GPUs a plain ``DDPStrategy`` does the same thing."""

    def _register_ddp_hooks(self) -> None:
        if self._ddp_comm_hook is not None:
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


class Steps(torch.utils.data.Dataset[int]):
    """Step numbers; each rank builds its own batch of the step from the shipped text."""

    def __init__(self, steps: int):
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> int:
        return i


class TinyLM(L.LightningModule):
    """The tiny transformer; ``fsdp_codec``: shard it in ``configure_model`` (FSDP2) and
    give every FSDP module dynamiq's reduce-scatter."""

    def __init__(self, items: int, fsdp_codec: str | None = None):
        super().__init__()
        self.items = items  # the data set's length (all ranks together)
        self.fsdp_codec = fsdp_codec
        self.model = build_model(CFG.model_config(), CFG.seed)
        self.text = doc_text()
        self.losses: list[float] = []
        self.fsdp_state: Any = None

    def configure_model(self) -> None:
        if self.fsdp_codec is None or self.fsdp_state is not None:
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:  # FSDP2: each block, then the root
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        # the one line: every FSDP module's reduce-scatter goes through dynamiq
        self.fsdp_state = dynamiq.fsdp.compress(self.model, codec=self.fsdp_codec)

    def training_step(self, step: torch.Tensor, _: int) -> torch.Tensor:
        batch = _batch(self.text, CFG, dist.get_rank(), dist.get_world_size(), int(step[0]))
        loss = lm_loss(self.model, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3)

    def train_dataloader(self) -> torch.utils.data.DataLoader[int]:
        return torch.utils.data.DataLoader(Steps(self.items), batch_size=1)


def fit(strategy: str, codec: str, steps: int, root: str) -> dict[str, Any]:
    """One Lightning run on this process's rank; its losses and dynamiq's statistics."""
    world = dist.get_world_size()
    # (Lightning's distributed sampler gives each rank `steps` of the `steps * world` items)
    module = TinyLM(steps * world, fsdp_codec=codec if strategy == "fsdp" else None)
    ddp_state = None
    if strategy == "ddp":
        # dynamiq's DDP hook: the state makes its own process group, so torch.distributed
        # must be initialised first (done in main(); Lightning then uses that group)
        ddp_state = DynamiqState(codec=codec, schedule="ring")
        strat: Any = DynamiqDDPStrategy(  # on GPUs: DDPStrategy(ddp_comm_state=..., ...)
            process_group_backend="gloo", ddp_comm_state=ddp_state, ddp_comm_hook=dynamiq_hook
        )
    else:  # Lightning's FSDP2 path (its FSDPStrategy is FSDP1)
        strat = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strat,
        max_steps=steps,
        default_root_dir=root,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    stats = ddp_state.stats if ddp_state is not None else module.fsdp_state.stats
    if ddp_state is not None:
        ddp_state.close()
    return {"losses": module.losses, "comm_stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", nargs="+", choices=["ddp", "fsdp"], default=["ddp"])
    parser.add_argument("--codec", default="dynamiq", help="codec id")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--root", help="Lightning's default_root_dir (default: a temp dir)")
    parser.add_argument("--json", metavar="FILE", help="write losses and comm stats (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's rendezvous; before any DynamiqState
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in args.strategy:
            res = fit(strategy, args.codec, args.steps, args.root or tmp)
            out[strategy] = res
            if dist.get_rank() == 0:
                first, last = res["losses"][0], sum(res["losses"][-5:]) / 5
                sent = sum(s["bytes_sent"] for s in res["comm_stats"]) / args.steps
                print(
                    f"Lightning {strategy}, gloo, {dist.get_world_size()} ranks, codec "
                    f"{args.codec}: loss {first:.4f} -> {last:.4f} after {args.steps} steps, "
                    f"{sent / 1e6:.3f} MB sent per step by rank 0 through dynamiq"
                )
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
