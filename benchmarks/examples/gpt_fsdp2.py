"""A small GPT-style model on synthetic tokens with AMP (bf16 autocast), torch.compile and
FSDP2 (world size 1 is fine): tokens/s for AdamW (fused) versus AdaPNM.

    python benchmarks/examples/gpt_fsdp2.py [--steps 50] [--layers 6] [--dim 512] [--no-compile]
    torchrun --nproc-per-node N benchmarks/examples/gpt_fsdp2.py     # several GPUs

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
from pnm_kernels import AdaPNM  # noqa: E402


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
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if name == "AdamW[fused]":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                fused=device.type == "cuda")
    else:
        state_dtype = getattr(torch, args.state_dtype) if args.state_dtype else None
        opt = AdaPNM(model.parameters(), lr=3e-4, weight_decay=0.1, state_dtype=state_dtype)

    def step(idx):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    if args.compile:
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
    return tokens / elapsed, loss.item()


def run(args, cuda):
    """Trains with each optimizer in turn; prints and returns tokens/s and final losses."""
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    results = {}
    names = ("AdamW[fused]", "AdaPNM")
    for name in names:
        results[name] = train(name, args, device, rank)
    if rank == 0:
        where = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"GPT {args.layers}x{args.dim}, seq {args.seq}, batch {args.batch}/rank, "
              f"world {dist.get_world_size()}, {where}, compile={args.compile}, "
              f"AdaPNM state_dtype={args.state_dtype or 'None'}")
        for name, (tps, loss) in results.items():
            print(f"  {name:<14} {tps:12,.0f} tokens/s   final loss {loss:.3f}")
        print(f"  AdaPNM / AdamW throughput: {results['AdaPNM'][0] / results['AdamW[fused]'][0]:.3f}")
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
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16"],
                        help="AdaPNM's state_dtype (default: the parameters' float32)")
    args = parser.parse_args(argv)
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
