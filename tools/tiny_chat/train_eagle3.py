"""Train the EAGLE-3 draft of `tiny-chat` by self-distillation and export it in the public layout
(issue 35; docs/serving.md §15). Seeded; one thread.

Command of the committed draft (src/m2serve/checkpoints/tiny-chat-eagle3)::

    python tools/tiny_chat/train_eagle3.py --out RUN_EAGLE3 --examples 3200 --steps 2400 \
        --kind-weights 0.16,0.40,0.06,0.08,0.08,0.22 --export src/m2serve/checkpoints/tiny-chat-eagle3

(``--kind-weights`` is the training mix over data.KINDS: tool_call, tool_result, no_tool, plain, repeat,
natural_result. The first shipped draft used the defaults, 2400 examples and 1400 steps; its acceptance on
tool-result turns was 0.58 at position 1 and the engine ran them at 0.99x plain, so the second weights
tool-result and natural_result turns more: 0.80 at position 1, 1.08x; README "Benchmarks", EAGLE-3.)

What it does:
1. Data: ``--examples`` train-split conversations (tools/tiny_chat/data.py ``make_examples("train", n,
   seed=--data-seed)``, every kind, natural_result included), rendered by the server's chat pipeline
   (the checkpoint's template) and continued by the TARGET's own greedy output (``--max-tokens``, fp32,
   m2serve's LLM): the draft must predict what the target generates, not the data. The measurement
   set is held out twice over: eval-split values, and prompts drawn with eagle3.EVAL_SEED, a seed no
   other consumer uses.
2. One target pass per sequence (``MiniMaxM2ForCausalLM.aux_hidden``, the default aux ids of a
   4-layer target, config/eagle3.py ``default_aux_layer_ids``): the aux states of every index and
   the logits of the response indices, kept in memory (bf16).
3. Training: the draft reads the target's frozen embedding (not stored in the draft: vLLM and our
   loader share the target's when the draft has no ``embed_tokens``); its ``lm_head`` starts from the
   target's tied head and its ``norm`` from the target's final norm; draft vocabulary = the target's
   1536 ids (a frequency subset would save little at this size, so ``d2t`` is all zeros and ``t2d``
   all true). Loss: soft cross-entropy to the target's distribution on the response indices, summed
   over ``--ttt-steps`` training-time-test unroll steps (eagle3.DraftNet.unroll; step j weighted
   ``--step-decay`` ** j); AdamW, linear warm-up and decay, batches of similar prompt length.
4. Measurement on the held-out set (eagle3.acceptance, K = 3 and 4) with the exported (bf16) weights,
   written to ``OUT/metrics.json`` and printed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from safetensors.torch import save_file  # noqa: E402
from tools.tiny_chat import data  # noqa: E402
from tools.tiny_chat import eagle3 as e3  # noqa: E402

from m2serve.config.eagle3 import Eagle3DraftConfig, default_aux_layer_ids  # noqa: E402

KIND_WEIGHTS = (0.30, 0.28, 0.10, 0.08, 0.10, 0.14)   # KINDS order: natural_result included


def draft_config(args, target_cfg: dict, aux_ids: tuple[int, ...]) -> dict:
    """The exported config.json (SpecForge's LlamaForCausalLMEagle3 fields our loader reads)."""
    V, H = target_cfg["vocab_size"], target_cfg["hidden_size"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": H, "target_hidden_size": H, "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads, "head_dim": H // args.heads,
            "intermediate_size": args.intermediate, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "vocab_size": V, "draft_vocab_size": V, "tie_word_embeddings": False,
            "norm_before_residual": False, "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}}


def build_seqs(model, examples, max_tokens: int, aux_ids, log) -> list[e3.TargetSeq]:
    """Prompts -> the target's greedy continuations -> one target pass each (module docstring 1-2)."""
    t0 = time.time()
    prompts = e3.chat_prompts(examples)
    conts = e3.greedy_continuations(prompts, max_tokens)
    log(f"generated {sum(map(len, conts))} tokens for {len(prompts)} prompts in {time.time() - t0:.0f} s")
    seqs = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(conts[i]))
    for b in range(0, len(order), 16):
        group = order[b: b + 16]
        full = [prompts[i] + conts[i] for i in group]
        for i, ids, (aux, logits) in zip(group, full, e3.target_pass(model, full, aux_ids)):
            p = len(prompts[i])
            seqs.append(e3.TargetSeq(torch.tensor(ids), p, aux.bfloat16(), logits[p - 1:].bfloat16()))
    log(f"target pass done in {time.time() - t0:.0f} s")
    return seqs


def export(net: e3.DraftNet, cfg: dict, out: Path) -> None:
    """config.json + model.safetensors (bf16 weights, d2t int64 zeros, t2d bool ones)."""
    out.mkdir(parents=True, exist_ok=True)
    V = cfg["vocab_size"]
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in net.state().items()}
    tensors["d2t"] = torch.zeros(cfg["draft_vocab_size"], dtype=torch.int64)
    tensors["t2d"] = torch.ones(V, dtype=torch.bool)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="run directory (data cache, metrics, draft)")
    ap.add_argument("--export", type=Path, help="also write the draft here")
    ap.add_argument("--examples", type=int, default=2400)
    ap.add_argument("--kind-weights", default=",".join(map(str, KIND_WEIGHTS)),
                    help="training mix over data.KINDS, comma-separated, in that order")
    ap.add_argument("--data-seed", type=int, default=35)
    ap.add_argument("--eval-per-kind", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--step-decay", type=float, default=0.8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()
    try:
        weights = tuple(float(w) for w in args.kind_weights.split(","))
    except ValueError:
        ap.error(f"--kind-weights {args.kind_weights!r}: comma-separated numbers, one per kind {data.KINDS}")
    if len(weights) != len(data.KINDS) or not all(map(math.isfinite, weights)) or min(weights) < 0 \
            or sum(weights) <= 0:
        ap.error(f"--kind-weights: {len(weights)} weights for {len(data.KINDS)} kinds {data.KINDS}, "
                 "each >= 0, not all 0")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    logf = open(args.out / "log.txt", "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    log(f"args {vars(args)}")
    target_cfg = json.loads((e3.TARGET / "config.json").read_text())
    aux_ids = default_aux_layer_ids(target_cfg["num_hidden_layers"])
    model = e3.load_target()
    cache = args.out / "data.pt"
    made_with = {"examples": args.examples, "data_seed": args.data_seed, "kind_weights": list(weights),
                 "eval_per_kind": args.eval_per_kind, "max_tokens": args.max_tokens}
    stamp = args.out / "data.json"   # the options data.pt was made with: a rerun must not mix them up
    if cache.exists():
        was = json.loads(stamp.read_text()) if stamp.exists() else None
        if was != made_with:
            made = f"made with {was}" if was is not None else f"has no {stamp.name} (options unknown)"
            ap.error(f"{cache} {made}, not {made_with}: use another --out or delete it")
        train, held = torch.load(cache, weights_only=False)
        log(f"data from {cache}")
    else:
        train = build_seqs(model, data.make_examples("train", args.examples, args.data_seed, weights),
                           args.max_tokens, aux_ids, log)
        held_ex = [ex for kind in data.KINDS
                   for ex in data.eval_subset(kind, args.eval_per_kind, e3.EVAL_SEED)]
        held = build_seqs(model, held_ex, args.max_tokens, aux_ids, log)
        torch.save((train, held), cache)
        stamp.write_text(json.dumps(made_with))
    log(f"train {len(train)} seqs, {sum(len(s.ids) - s.prompt_len for s in train)} response tokens; "
        f"held-out {len(held)} seqs")

    cfg = draft_config(args, target_cfg, aux_ids)
    dcfg = Eagle3DraftConfig.from_dict(cfg)
    embed = model.model.embed_tokens.weight.detach().float()
    init = {"lm_head.weight": embed, "norm.weight": model.model.norm.weight.detach().float()}
    net = e3.DraftNet(dcfg, embed, init, torch.Generator().manual_seed(args.seed))
    opt = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed)
    by_len = sorted(range(len(train)), key=lambda i: train[i].prompt_len)
    batches = [by_len[b: b + args.batch] for b in range(0, len(by_len), args.batch)]
    t0 = time.time()
    order: list[list[int]] = []
    running = [0.0, 0.0]
    for step in range(args.steps):
        if not order:
            order = batches[:]
            rng.shuffle(order)
        tok, aux, lg, lens, plens = e3.pad_batch([train[i] for i in order.pop()])
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * max(0.05, 1 - step / args.steps)
        for grp in opt.param_groups:
            grp["lr"] = lr
        q0 = e3.query_start(plens, args.ttt_steps)
        outs = net.unroll(tok, aux, args.ttt_steps, q_start=q0)
        loss = torch.zeros(())
        acc0 = None
        for j, logits in enumerate(outs):
            mask = e3.step_mask(lens, plens, tok.shape[1], j)[:, q0:]
            teacher = e3.shift(lg, j)[:, q0:][mask]
            pred = logits[mask]
            ce = -(F.softmax(teacher, -1) * F.log_softmax(pred, -1)).sum(-1).mean()
            loss = loss + args.step_decay ** j * ce
            if j == 0:
                acc0 = (pred.argmax(-1) == teacher.argmax(-1)).float().mean().item()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        running[0] += loss.item()
        running[1] += acc0
        if (step + 1) % args.log_every == 0:
            n = args.log_every
            log(f"step {step + 1} loss {running[0] / n:.3f} top1@1 {running[1] / n:.3f} lr {lr:.2e} "
                f"{time.time() - t0:.0f} s")
            running = [0.0, 0.0]
    torch.save(net.state(), args.out / "draft.pt")
    export(net, cfg, args.out / "draft")
    if args.export:
        export(net, cfg, args.export)
    # measure with the exported (bf16-rounded) weights
    state = {k: v.float() for k, v in e3.load_state(args.out / "draft").items()}
    net_b = e3.DraftNet(dcfg, embed, state)
    metrics = {f"K={k}": e3.acceptance(net_b, held, k) for k in (3, 4)}
    metrics["train_seconds"] = time.time() - t0
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(json.dumps(metrics))


if __name__ == "__main__":
    main()
