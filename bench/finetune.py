"""LoRA fine-tuning against PEFT + transformers: the same base, data, adapters, rank and
optimizer, in one run.

    python bench/finetune.py [--gguf FILE] [--steps 20] [--rounds 2] [--batch 4] [--rank 8]

- The base: SmolLM2-135M-Instruct (`make chat` fetches its GGUF), converted once to a Hugging
  Face directory in float32 (`--to hf`, kept beside the GGUF) so both sides load the same
  weights.
- The data: the `make chat-tune` conversations (research/module_chats.py, rendered by the
  model's chat template), one per row of `--seq-len` tokens (right-padded: no packing, which
  transformers' Llama would need a mask for), the same rows in the same order on both sides;
  the loss is the mean cross-entropy over the assistant's tokens.
- The adapters: PEFT's own fresh LoRA (Kaiming-uniform A, zero B) on every Linear of the
  layers, saved once; transformers loads it with `PeftModel.from_pretrained(is_trainable)`,
  ours with `init_from` the adapter directory, so both start from the same A.
- The optimizer: AdamW (lr 1e-3 constant, betas 0.9/0.95, eps 1e-8, no weight decay) after
  clipping the gradient norm to 1, float32, no dropout.

Each side runs in its own process (rounds alternate); printed: the first `--steps` losses of
each and their largest relative difference, the median step time, the conversations' tokens
per second (padding not counted; compile and the first step excluded) and each process's peak
RSS — for the same padded rows on both sides, and as each stack runs a chat set: ours packing
conversations into rows (its default), transformers padding each batch to its longest row (its
collators' way; packing there needs flash-attention's varlen kernels, which CPUs lack).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_rss_bytes, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = Path.home() / ".cache" / "llama_jax" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
           "w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
LR, BETAS, EPS, CLIP = 1e-3, (0.9, 0.95), 1e-8, 1.0


def prepare(gguf: Path, rank: int) -> tuple[Path, Path, Path]:
    """(the float32 HF base, the fresh PEFT adapter, the conversations), made once."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from llama_jax.config import DEFAULT_CORPUS
    from llama_jax.formats.convert import convert
    from llama_jax.research import module_chats

    work = gguf.parent / f"{gguf.stem}.finetune-bench"
    base, adapter, data = work / "hf", work / f"adapter-r{rank}", work / "data"
    if not base.exists():
        convert(gguf, base, to="hf", dtype="float32", reference=False)
    if not (data / "train.jsonl").is_file():
        module_chats.build(Path(DEFAULT_CORPUS), data)
    if not adapter.exists():
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(0)
        get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                         target_modules=list(TARGETS.values()))
                       ).save_pretrained(adapter)
    return base, adapter, data


def rows(gguf: Path, data: Path, seq_len: int, packing: bool = False) -> dict:
    """The training conversations in file order, one per row (or packed), as numpy arrays
    `[n, seq_len]`."""
    import llama_jax
    from llama_jax.data import chat_rows, conversations

    tokenizer = llama_jax.load_tokenizer(gguf)
    chats = conversations.read_conversations(
        data / "train.jsonl", conversations.chat_template_for([gguf]), tokenizer, seq_len,
        truncate=True)
    return chat_rows.pack(chats, seq_len, packing, tokenizer.eos_ids[0])


def real_tokens(batch: dict) -> int:
    """The conversations' tokens in a batch of rows (padding has segment id 0)."""
    return int((batch["segment_ids_BT"] > 0).sum())


def result(losses: list[float], times: list[float], tokens: list[int]) -> dict:
    """A side's measurements; the first step (compile, warm-up) is left out of the rates."""
    return {"losses": losses, "step_s": statistics.median(times[1:]),
            "real_tokens_per_s": sum(tokens[1:]) / sum(times[1:]),
            "peak_rss_mib": peak_rss_bytes() / 2**20}


def ours(args, base: Path, adapter: Path, data: Path, packing: bool = False) -> dict:
    import jax
    import yaml

    from llama_jax.parallel import sharding
    from llama_jax.training import finetune, trainer

    tree = {"init_from": str(adapter),
            "lora": {"rank": args.rank, "alpha": 2 * args.rank, "dropout": 0.0,
                     "targets": list(TARGETS)},
            "task": {"kind": "chat", "train": str(data / "train.jsonl"), "packing": packing},
            "train": {"seq_len": args.seq_len, "batch_size": args.batch, "steps": args.steps,
                      "learning_rate": LR, "schedule": "constant", "warmup_steps": 0,
                      "b1": BETAS[0], "b2": BETAS[1], "eps": EPS, "clip_norm": CLIP,
                      "weight_decay": 0.0}}
    config = Path(args.tmp) / "ours.yaml"
    config.write_text(yaml.safe_dump(tree))
    run = finetune.load_run_config(config)
    batches = rows(args.gguf, data, args.seq_len, packing)
    mesh = sharding.make_mesh(run.mesh)
    programs = trainer.compile_programs(run, 0, mesh, evaluate=False)
    state = programs.init(jax.random.key(0))
    frozen = finetune.load_base(run, mesh)
    losses, times, tokens = [], [], []
    for i in range(args.steps):
        batch = {k: v[i * args.batch:(i + 1) * args.batch] for k, v in batches.items()}
        start = time.perf_counter()
        state, metrics = programs.step(state, jax.device_put(batch, programs.batch_sharding),
                                       frozen)
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - start)
        tokens.append(real_tokens(batch))
    return result(losses, times, tokens)


def peft_side(args, base: Path, adapter: Path, data: Path, trim: bool = False) -> dict:
    """`trim`: each batch cut to its longest row, as transformers' collators pad."""
    import torch
    import transformers
    from peft import PeftModel

    batches = rows(args.gguf, data, args.seq_len)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True).train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    losses, times, tokens = [], [], []
    for i in range(args.steps):
        rows_of = {k: v[i * args.batch:(i + 1) * args.batch] for k, v in batches.items()}
        width = int((rows_of["segment_ids_BT"] > 0).sum(1).max()) if trim else args.seq_len
        batch = {k: torch.as_tensor(v[:, :width]) for k, v in rows_of.items()}
        start = time.perf_counter()
        logits = model(input_ids=batch["inputs_BT"].long(),
                       position_ids=batch["positions_BT"].long()).logits
        nll = -torch.log_softmax(logits.float(), -1).gather(
            -1, batch["targets_BT"].long()[..., None])[..., 0]
        weights = batch["weights_BT"].float()
        loss = (nll * weights).sum() / weights.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        times.append(time.perf_counter() - start)
        tokens.append(real_tokens(rows_of))
    return result(losses, times, tokens)


# the same rows on both sides (the losses compared), then each side as it runs a chat set:
# ours packed (its default), transformers with each batch padded to its longest row
SIDES = {"ours": ours, "peft": peft_side,
         "ours-packed": lambda *a: ours(*a, packing=True),
         "peft-padded-to-longest": lambda *a: peft_side(*a, trim=True)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tmp", default="/tmp", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a side
    args = parser.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"error: {args.gguf}: no such file (make chat fetches it)")
    base, adapter, data = prepare(args.gguf, args.rank)
    if args.child:
        print(json.dumps(SIDES[args.child](args, base, adapter, data)))
        return 0
    flags = ["--gguf", str(args.gguf), "--steps", str(args.steps), "--batch", str(args.batch),
             "--seq-len", str(args.seq_len), "--rank", str(args.rank)]
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for side in SIDES:
            results.setdefault(side, []).append(run_child(__file__, *flags, "--child", side))
    first = {side: runs[0]["losses"] for side, runs in results.items()}
    worst = max(abs(a - b) / abs(b) for a, b in zip(first["ours"], first["peft"]))
    print("step | ours | peft")
    for i, (a, b) in enumerate(zip(first["ours"], first["peft"]), 1):
        print(f"{i:4d} | {a:.5f} | {b:.5f}")
    print(f"largest relative loss difference over {args.steps} steps: {worst:.2e}")
    rate = {side: statistics.median(r["real_tokens_per_s"] for r in runs)
            for side, runs in results.items()}
    print("| side | step (s) | conversation tokens/s | peak RSS (MiB) |")
    print("|---|---|---|---|")
    for side, runs in results.items():
        print(f"| {side} | {statistics.median(r['step_s'] for r in runs):.3f} | "
              f"{rate[side]:,.0f} | {statistics.median(r['peak_rss_mib'] for r in runs):,.0f} |")
    print(f"same rows, ours / peft: {rate['ours'] / rate['peft']:.2f}x; as each runs a chat "
          f"set, ours packed / peft padded to the longest row: "
          f"{rate['ours-packed'] / rate['peft-padded-to-longest']:.2f}x "
          f"(medians of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
