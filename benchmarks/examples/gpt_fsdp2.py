"""A small GPT-style model on synthetic tokens with AMP (bf16 autocast), torch.compile and
FSDP2 (world size 1 is fine): tokens/s for AdamW (fused) versus AdaPNM (and PNM).

    python benchmarks/examples/gpt_fsdp2.py [--steps 50] [--layers 6] [--dim 512] [--no-compile]
    torchrun --nproc-per-node N benchmarks/examples/gpt_fsdp2.py     # several GPUs

--step-in-backward: ours step inside backward (optimizer.step_in_backward(); AdamW as before,
its reference), under FSDP2 as without it (--no-fsdp: one process, no FSDP2). With
--param-dtype bfloat16 our parameters are bfloat16, written with stochastic rounding. On a
GPU each run reports its peak memory and the bytes per parameter beyond the activations
(peak minus what a forward and backward alone, gradients freed as made, added to the
parameters).

Meant for a GPU (NCCL); on a CPU it runs with gloo, small sizes and no real meaning for speed
(use --steps 3 --layers 2 --dim 64 as a smoke test).
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from pnm_kernels import PNM, AdaPNM  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(name, args, device, rank):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ours = name != "AdamW[fused]"
    param_dtype = getattr(torch, args.param_dtype) if ours else torch.float32
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device, param_dtype)
    if not args.no_fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    if not ours:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                fused=device.type == "cuda")
    else:
        state_dtype = getattr(torch, args.state_dtype) if args.state_dtype else None
        cls, lr = (AdaPNM, 3e-4) if name == "AdaPNM" else (PNM, 3e-2)
        opt = cls(model.parameters(), lr=lr, weight_decay=0.1, state_dtype=state_dtype,
                  bf16_stochastic_round=param_dtype == torch.bfloat16)
        if args.step_in_backward:
            opt.step_in_backward()

    def forward_backward(idx):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach()

    def step(idx):
        loss = forward_backward(idx)
        opt.step()
        opt.zero_grad()
        return loss

    if args.compile and args.step_in_backward:
        model = torch.compile(model)  # the hooks step in eager autograd, after its backward
    elif args.compile:
        step = torch.compile(step)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
               for _ in range(4)]
    for i in range(args.warmup):
        step(batches[i % 4])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % 4])
    sync()
    elapsed = time.perf_counter() - start
    tokens = args.steps * args.batch * args.seq * dist.get_world_size()
    memory = _memory_per_parameter(model, opt, forward_backward, batches[0], device)
    return tokens / elapsed, loss.item(), memory


def _memory_per_parameter(model, opt, forward_backward, idx, device):
    """(peak MiB of the timed steps, bytes per parameter beyond the activations) on CUDA:
    the activations are what a forward and backward alone add to the parameters at their
    peak, each gradient freed as soon as it is made. None on a CPU."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    params = list(model.parameters())
    handle = getattr(opt, "_in_backward", None)
    if handle is not None:
        handle.remove()
    opt.zero_grad()
    frees = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
             for p in params]
    state = {p: opt.state.pop(p, None) for p in params}  # the optimizer's state set aside
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_allocated(device)
    forward_backward(idx)
    activations = torch.cuda.max_memory_allocated(device) - start
    for hook in frees:
        hook.remove()
    opt.state.update({p: s for p, s in state.items() if s is not None})
    count = sum(p.numel() for p in params)
    return peak / 2**20, (peak - activations) / count


def run(args, cuda):
    """Trains with each optimizer in turn; prints and returns tokens/s and final losses."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    results = {}
    for name in args.optimizers.split(","):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        results[name] = train(name, args, device, rank)
    if rank == 0:
        where = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"GPT {args.layers}x{args.dim}, seq {args.seq}, batch {args.batch}/rank, "
              f"world {dist.get_world_size()}, {where}, compile={args.compile}, "
              f"ours: state_dtype={args.state_dtype or 'None'}, parameters {args.param_dtype}, "
              f"step in backward {args.step_in_backward}")
        for name, (tps, loss, memory) in results.items():
            where = "" if memory is None else (
                f"   peak {memory[0]:9,.0f} MiB, {memory[1]:.2f} bytes/parameter beyond activations")
            print(f"  {name:<14} {tps:12,.0f} tokens/s   final loss {loss:.3f}{where}")
        if "AdamW[fused]" in results:
            for name in [n for n in results if n != "AdamW[fused]"]:
                print(f"  {name} / AdamW throughput: "
                      f"{results[name][0] / results['AdamW[fused]'][0]:.3f}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16", "int8"],
                        help="our state_dtype (default: the parameters')")
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="our parameters' dtype (bfloat16: written with stochastic rounding)")
    parser.add_argument("--optimizers", default="AdamW[fused],AdaPNM",
                        help="comma-separated, from AdamW[fused], AdaPNM, PNM")
    parser.add_argument("--step-in-backward", action="store_true",
                        help="ours step inside backward (FSDP2's shards too)")
    parser.add_argument("--no-fsdp", action="store_true",
                        help="one process without FSDP2")
    args = parser.parse_args(argv)
    unknown = set(args.optimizers.split(",")) - {"AdamW[fused]", "AdaPNM", "PNM"}
    if unknown:
        parser.error(f"unknown optimizers {sorted(unknown)}")
    if args.no_fsdp and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--no-fsdp runs in one process")
    cuda = torch.cuda.is_available()
    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if cuda else "gloo",
                                rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    try:
        results = run(args, cuda)
    finally:  # a failed run leaves no process group behind (tests run in one process)
        if created:
            dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
