"""--optim muon: Muon (orthogonalized momentum) for the hidden weight matrices, AdamW for the rest, as one optimizer.

Muon updates a matrix by its momentum's nearest semi-orthogonal matrix (5 Newton-Schulz iterations, Keller Jordan's
coefficients), as `torch.optim.Muon` (torch 2.13) defines it; embeddings, the LM head, norms and biases keep AdamW.
`MuonWithAdamW` holds both kinds of parameter group, so the loop keeps one optimizer, one schedule and one
`optimizer.step()`, and its `state_dict` holds both states (Muon's one momentum buffer per matrix, AdamW's two
moments), which checkpoints and the exact resume need. It is not `torch.optim.Muon` itself because that one
- runs Newton-Schulz in bf16 everywhere: here bf16 on a GPU (as torch does), fp32 on CPU, so that 2 processes equal 1
  to fp32 rounding;
- orthogonalizes whatever tensor it holds: under FSDP2 or tensor parallelism a process's row shard, which is not Muon
  on the matrix. Here a sharded matrix (a DTensor) is gathered whole (`full_tensor()`: one all-gather of the matrix
  per step, as FSDP2's forward does for the weights), orthogonalized on every process (Newton-Schulz's compute repeated
  on each) and each process keeps its own shard of the result;
- cannot skip a non-finite step on the device: here, as fused AdamW does, the divergence guard's `found_inf` leaves
  weights, momentum and moments untouched without a read to the host.
Under DeepSpeed ZeRO a client optimizer only sees flattened partitions: there DeepSpeed's own ZeRO Muon is configured
from the same flags (`deepspeed_muon_block`, `deepspeed_muon_groups`).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch import nn
from torch.optim.adamw import adamw

from common.errors import fail
from common.optim import param_groups

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_EPS = 1e-7
MAX_BATCH_ELEMENTS = 1 << 18  # one Newton-Schulz batch: 1 MB of fp32, what a core's L2 cache holds


def add_muon_args(parser: argparse.ArgumentParser) -> None:
    """`muon` becomes a choice of --optim, with Muon's own flags."""
    optim = next(action for action in parser._actions if "--optim" in action.option_strings)  # argparse: no accessor
    optim.choices = (*optim.choices, "muon")
    optim.help += " muon: Muon for the hidden matrices, AdamW for the rest; it skips on the device too."
    g = parser.add_argument_group("muon")
    g.add_argument("--muon_momentum", type=float, default=0.95, help="--optim muon: Muon's momentum.")
    g.add_argument("--muon_nesterov", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="--optim muon: Nesterov momentum (true/false).")
    g.add_argument("--muon_ns_steps", type=int, default=5, help="--optim muon: Newton-Schulz iterations.")
    g.add_argument("--muon_adjust_lr_fn", default="match_rms_adamw", choices=("match_rms_adamw", "original"),
                   help="--optim muon: match_rms_adamw scales each matrix's update to AdamW's RMS (0.2 sqrt(max(A, "
                        "B))), so --learning_rate and --weight_decay carry over from AdamW; original: sqrt(max(1, "
                        "A/B)), which wants a larger --muon_learning_rate (~0.02).")
    g.add_argument("--muon_learning_rate", type=float, default=None,
                   help="--optim muon: peak learning rate of the Muon matrices (None: --learning_rate).")


def check_muon_flags(args: argparse.Namespace) -> None:
    if args.optim != "muon":
        return
    if not 0 <= args.muon_momentum < 1:
        fail(f"--muon_momentum must be in [0, 1) (got {args.muon_momentum})")
    if not 1 <= args.muon_ns_steps < 100:
        fail(f"--muon_ns_steps must be between 1 and 99 (got {args.muon_ns_steps})")
    if args.muon_learning_rate is not None and args.muon_learning_rate <= 0:
        fail(f"--muon_learning_rate must be > 0 (got {args.muon_learning_rate})")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    if not args.muon_nesterov or args.muon_ns_steps != 5:
        fail("--optim muon under DeepSpeed: DeepSpeed's ZeRO Muon has Nesterov momentum and 5 Newton-Schulz steps "
             "built in; keep --muon_nesterov true and --muon_ns_steps 5")
    if args.max_grad_norm > 0:  # DeepSpeed would clip Muon's orthogonalized updates (norm ~ sqrt(sum of min(A, B)))
        if os.environ.get("RANK", "0") == "0":
            print(f"--optim muon under DeepSpeed: no gradient clipping (--max_grad_norm {args.max_grad_norm} "
                  "ignored): DeepSpeed's ZeRO Muon clips the orthogonalized update, not the gradient, which would "
                  "shrink every Muon step by its norm", flush=True)
        args.max_grad_norm = 0.0
    if getattr(args, "use_peft", False):
        fail("--optim muon with --use_peft: Muon is for a pretraining run's hidden matrices, not for LoRA's low-rank "
             "adapters; use an AdamW --optim")


def muon_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters Muon updates: the 2-D hidden matrices (attention and MLP projections). Embeddings and the
    LM head (input and output layers), norms, biases and other shapes go to AdamW. Under ZeRO-3 a partitioned
    parameter keeps its real shape in `ds_shape`."""
    outer = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    outer |= {id(p) for p in head.parameters()} if head is not None else set()
    return {id(p) for p in model.parameters()
            if p.requires_grad and id(p) not in outer and len(getattr(p, "ds_shape", p.shape)) == 2}


def create_muon_optimizer(args: argparse.Namespace, model: nn.Module) -> MuonWithAdamW:
    """`create(args, model)` for common/optim.py: the Muon matrices in one group, AdamW's groups as --optim
    adamw_torch_fused builds them (matrices decayed, 1-D parameters not)."""
    matrices = muon_matrices(model)
    muon = {"params": [p for p in model.parameters() if id(p) in matrices], "use_muon": True,
            "lr": args.muon_learning_rate or args.learning_rate, "weight_decay": args.weight_decay}
    adamw = [{**group, "params": [p for p in group["params"] if id(p) not in matrices]}
             for group in param_groups(model, args.weight_decay)]
    return MuonWithAdamW([muon] + [group for group in adamw if group["params"]], lr=args.learning_rate,
                         betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                         momentum=args.muon_momentum, nesterov=args.muon_nesterov, ns_steps=args.muon_ns_steps,
                         adjust_lr_fn=args.muon_adjust_lr_fn)


def muon_optimizer(args: argparse.Namespace, model: nn.Module, accelerator):
    """The recipe's hook: with --optim muon, the factory of `MuonWithAdamW` (under DeepSpeed: of the placeholder of
    DeepSpeed's ZeRO Muon, after writing that into its config); else None (the core's optimizers)."""
    if args.optim != "muon":
        return None
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return create_muon_optimizer
    plugin.deepspeed_config["optimizer"] = deepspeed_muon_block(args)  # deepspeed.initialize tags the matrices
    zero = plugin.deepspeed_config.setdefault("zero_optimization", {})
    if zero.get("stage") == 3:  # ZeRO-3's Muon refuses reduce-scatter (its default): all-reduce the whole gradients
        zero["reduce_scatter"] = False
    return create_deepspeed_muon_placeholder


def create_deepspeed_muon_placeholder(args: argparse.Namespace, model: nn.Module):
    """accelerate's `DummyOptim` over `deepspeed_muon_groups`: DeepSpeed builds its ZeRO Muon from them."""
    from accelerate.utils import DummyOptim

    return DummyOptim(deepspeed_muon_groups(args, model), lr=args.learning_rate, weight_decay=args.weight_decay)


def deepspeed_muon_groups(args: argparse.Namespace, model: nn.Module) -> list[dict]:
    """The parameter groups handed to DeepSpeed's ZeRO Muon, which scales every matrix's update by sqrt(max(1,
    rows/cols)) (`original`) and decays by its group's lr x weight decay. For --muon_adjust_lr_fn match_rms_adamw the
    matrices of one scaling ratio get a group whose lr turns that into 0.2 sqrt(max(rows, cols)) and whose weight
    decay keeps lr x decay unscaled, as torch's Muon has it: the same flags give the same step size on every engine.
    DeepSpeed tags the Muon matrices itself (>= 2-D, not named embed/lm_head); a matrix both rules agree on is scaled,
    any other parameter keeps the config's rates (AdamW's groups: decayed matrices, undecayed 1-D parameters)."""
    ours = muon_matrices(model)
    matrices = {id(p) for name, p in model.named_parameters()
                if id(p) in ours and not any(word in name.lower() for word in ("embed", "lm_head"))}
    lr = args.muon_learning_rate or args.learning_rate
    by_ratio: dict[float, list] = {}
    for p in model.parameters():
        if id(p) in matrices:
            shape = getattr(p, "ds_shape", p.shape)
            by_ratio.setdefault(adjusted_lr(1.0, args.muon_adjust_lr_fn, shape) /
                                adjusted_lr(1.0, "original", shape), []).append(p)
    scaled = [{"params": params, "lr": lr * ratio, "weight_decay": args.weight_decay / ratio}
              for ratio, params in by_ratio.items()]
    rest = [{**group, "params": [p for p in group["params"] if id(p) not in matrices]}
            for group in param_groups(model, args.weight_decay)]
    return [group for group in rest if group["params"]] + scaled  # AdamW's first: the logged lr is --learning_rate


def deepspeed_muon_block(args: argparse.Namespace) -> dict:
    """DeepSpeed 0.19.8's ZeRO Muon (`deepspeed/runtime/zero/muon/`) from the flags; it replaces a JSON's own optimizer
    block (the offload configs' AdamW), as the flag decides the optimizer. ZeRO orthogonalizes each matrix whole (its
    partitions gathered); `deepspeed.initialize` tags the 2-D parameters not named embed/lm_head (`use_muon`)."""
    return {"type": "Muon", "params": {
        "lr": args.learning_rate, "muon_lr": args.muon_learning_rate or args.learning_rate,
        "adam_lr": args.learning_rate, "momentum": args.muon_momentum, "ns_method": "standard",
        "weight_decay": args.weight_decay, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon}}


def newton_schulz(x: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization (torch/optim/_muon.py) of a stack of wide matrices (rows <= columns) at
    once: one batched matmul per term instead of one per matrix (on CPU each matmul is a fork and join of the OpenMP
    threads, on a GPU a kernel launch)."""
    a, b, c = coefficients
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def same_shape_batches(params: list[torch.Tensor]):
    """The matrices in batches of one shape (a tall one beside its transpose's shape), each of at most
    MAX_BATCH_ELEMENTS, so that a step's extra memory stays one batch's."""
    shapes: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        shapes.setdefault((*sorted(p.shape), p.device), []).append(p)
    for (rows, cols, _), same in shapes.items():
        size = max(1, MAX_BATCH_ELEMENTS // (rows * cols))
        yield from (same[i:i + size] for i in range(0, len(same), size))


def orthogonalize(updates: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Each update's nearest semi-orthogonal matrix (Newton-Schulz, one batch), in bf16 on a GPU and fp32 on a CPU; a
    tall one is transposed to wide, as torch does. A shard of a matrix (a DTensor) is gathered whole, orthogonalized
    (on every process) and cut back to this process's shard."""
    wholes = [u.full_tensor() if hasattr(u, "full_tensor") else u for u in updates]
    tall = [w.size(0) > w.size(1) for w in wholes]
    x = torch.stack([w.mT if t else w for w, t in zip(wholes, tall)])
    x = newton_schulz(x.to(torch.bfloat16 if x.is_cuda else torch.float32), steps)
    result = [(o.mT if t else o).to(u.dtype) for o, t, u in zip(x, tall, updates)]
    if hasattr(updates[0], "full_tensor"):  # keep this process's shard of each whole result
        from torch.distributed.tensor import distribute_tensor

        result = [distribute_tensor(o, u.device_mesh, u.placements, src_data_rank=None)
                  for o, u in zip(result, updates)]
    return result


def adjusted_lr(lr: float, adjust_lr_fn: str, shape) -> float:
    """torch.optim.Muon's per-matrix learning-rate scaling."""
    rows, cols = shape[:2]
    return lr * (0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else
                 math.sqrt(max(1, rows / cols)))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a DTensor (a view of it), or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon`, AdamW (torch's kernels, fused where they can) for the others.

    A `found_inf` tensor set on it (the divergence guard, before `step`) makes a non-finite step leave every weight,
    momentum buffer, moment and step count as it was, decided on the device.
    """

    @property
    def skips_on_found_inf(self) -> bool:
        """Whether `found_inf` skips a step on the device (the divergence guard asks): torch's AdamW kernels honour
        it only fused (a resume restores the checkpoint's groups)."""
        return all(group["use_muon"] or group["fused"] for group in self.param_groups)

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str = "match_rms_adamw", fused: bool | None = None) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                                      use_muon=False, fused=fused))
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon only updates 2-D matrices")
            if not group["use_muon"] and group["fused"] is None:  # fused where every tensor is a float on one kind
                group["fused"] = all(p.is_floating_point() for p in group["params"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params and group["use_muon"]:
                self._muon_step(group, params, found_inf)
            elif params:
                self._adamw_step(group, params, found_inf)
        return loss

    def _muon_step(self, group: dict, params: list, found_inf: torch.Tensor | None) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for batch in same_shape_batches(params):
            new_bufs, updates = [], []
            for p in batch:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                new_bufs.append(state["momentum_buffer"].lerp(p.grad, 1 - momentum))
                updates.append(p.grad.lerp(new_bufs[-1], momentum) if group["nesterov"] else new_bufs[-1])
            for p, new_buf, orthogonal in zip(batch, new_bufs, orthogonalize(updates, group["ns_steps"])):
                buf = self.state[p]["momentum_buffer"]
                new_p = (p * (1 - lr * group["weight_decay"])).add_(orthogonal, alpha=-adjusted_lr(
                    lr, group["adjust_lr_fn"], p.shape))
                if found_inf is None:
                    _local(buf).copy_(_local(new_buf))
                    _local(p).copy_(_local(new_p))
                else:  # a non-finite step keeps the old values; decided on the device
                    skip = found_inf.to(dtype=torch.bool, device=_local(p).device)
                    _local(buf).copy_(torch.where(skip, _local(buf), _local(new_buf)))
                    _local(p).copy_(torch.where(skip, _local(p), _local(new_p)))

    def _adamw_step(self, group: dict, params: list, found_inf: torch.Tensor | None) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.AdamW lays out its state (a fused step count lives on the device)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if group["fused"] \
                    else torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps,
                                fused=group["fused"], found_inf=found_inf if group["fused"] else None,
                                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
