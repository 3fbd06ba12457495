"""Build a tiny model (a Qwen2, or a Qwen3-MoE with ``model.warm_start.arch: qwen3_moe``) and
warm-start it with a short supervised run on the synthetic task, so that RL starts from a policy
that is sometimes right (about 10-30 % exact answers on the held-out split after the default 150
steps; 600 steps reach about 90 %, measured on 2 cores).

Two options shape what RL starts from. ``lr_schedule: linear`` decays the learning rate to 0, so
the warm start ends settled (a constant high rate ends noisy, and a later RL run at a small rate
then gains merely by annealing it). ``mistake_fraction`` makes the demonstrations imperfect: that
fraction of the examples whose string has at least ``mistake_min_len`` characters lose their
answer's last character, as truncated answers in real fine-tuning data. The model then learns to
reverse, but greedy decoding stops one character early on most such strings while sampling still
finds the full answer often: the gap between pass@k and pass@1 that RL with a verifiable reward
closes (the shipped example starts near 0.2 exact and RL takes it to about 0.8).

The result is a normal Hugging Face directory (config.json, model.safetensors, char_vocab.json)
cached under ``<output_dir>/warm_start``. Its signature file records everything the built model
depends on (every warm-start setting, the task, the seed, the tokenizer's vocabulary, the model
shape including the context length derived from ``data.synthetic.max_len`` and
``rollout.max_new_tokens``, and the library versions); any difference rebuilds it.

The data package sits below the config assembler: it reads the run's settings as a :class:`Recipe`,
the config sections it needs, which ``AppConfig.warm_start_recipe`` (``areal_fast.config``) fills.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from areal_fast.data import tiny_task
from areal_fast.data.config import WarmStartConfig
from areal_fast.data.tiny_task import SyntheticTaskConfig
from areal_fast.data.tokenizer import SPECIALS, CharTokenizer

log = logging.getLogger(__name__)
SIGNATURE_FILE = "warm_start.json"
SIGNATURE_FORMAT = 3  # bump when the build or the recipe changes in a way the fields do not show (3: tokenizer.json)


@dataclass(frozen=True, slots=True)
class Recipe:
    """What the warm start reads from a run's config: its sections, not the whole config."""

    warm_start: WarmStartConfig  # model.warm_start
    task: SyntheticTaskConfig  # data.synthetic
    seed: int  # experiment.seed
    max_new_tokens: int  # rollout.max_new_tokens: with task.max_len, the model's context length
    out: Path  # where the built model is cached (<experiment.out>/warm_start)


def qwen2_kwargs(r: Recipe, tokenizer: CharTokenizer) -> dict:
    """Arguments of the ``transformers.Qwen2Config`` of the dense tiny model (:func:`build_tiny_model`;
    the Qwen3-MoE's start from them, :func:`model_kwargs`)."""
    ws = r.warm_start
    return dict(
        vocab_size=((tokenizer.vocab_size + 15) // 16) * 16,  # rows past the tokenizer are never trained on
        hidden_size=ws.hidden_size, intermediate_size=ws.intermediate_size,
        num_hidden_layers=ws.num_hidden_layers, num_attention_heads=ws.num_attention_heads,
        num_key_value_heads=ws.num_key_value_heads,
        # prompt + answer of the longest string, twice over, and never below 128 positions
        max_position_embeddings=max(128, 2 * (r.task.max_len + r.max_new_tokens)),
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="float32",
    )


MOE_FIELDS = ("arch", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def model_kwargs(r: Recipe, tokenizer: CharTokenizer) -> dict:
    """Arguments of the transformers config of the tiny model (``model.warm_start.arch``)."""
    ws = r.warm_start
    kw = qwen2_kwargs(r, tokenizer)
    if ws.arch == "qwen3_moe":  # every block sparse; head size as the dense model's
        kw.update(num_experts=ws.num_experts, num_experts_per_tok=ws.num_experts_per_tok,
                  moe_intermediate_size=ws.moe_intermediate_size, decoder_sparse_step=1, norm_topk_prob=True,
                  head_dim=ws.hidden_size // ws.num_attention_heads)
    return kw


def signature(r: Recipe) -> dict:
    """Everything the warm-started model depends on (the cache key)."""
    import importlib.metadata

    tok = CharTokenizer(tiny_task.vocabulary(r.task))
    versions = {}
    for dist in ("torch", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    ws = dataclasses.asdict(r.warm_start)
    if ws["arch"] == "qwen2":  # the dense model's key as before the MoE options existed
        for k in MOE_FIELDS:
            ws.pop(k)
    task = dataclasses.asdict(r.task)
    if not task["growth"]["rows"]:  # lengths that do not grow: the key as before the growth option existed
        task.pop("growth")
    return {"format": SIGNATURE_FORMAT, "warm_start": ws,
            "task": task, "seed": r.seed,
            "max_new_tokens": r.max_new_tokens, "max_len": r.task.max_len,
            "tokenizer": {"chars": tok.chars, "specials": list(SPECIALS)},
            "model": model_kwargs(r, tok), "versions": versions}


def build_tiny_model(r: Recipe, tokenizer: CharTokenizer):
    """The untrained tiny model of ``warm_start.arch``: a Qwen2, or a Qwen3-MoE (every block sparse)."""
    import torch
    import transformers

    torch.manual_seed(r.seed)
    if r.warm_start.arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**model_kwargs(r, tokenizer)))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**qwen2_kwargs(r, tokenizer)))


def _batch(rows, tok: CharTokenizer):
    import torch

    seqs, masks = [], []
    for r in rows:
        p = tok.encode(r["prompt"])
        a = tok.encode(r["answer"], add_bos=False) + [tok.eos_token_id]
        seqs.append(p + a)
        masks.append([0] * len(p) + [1] * len(a))
    t = max(map(len, seqs))
    x = torch.full((len(seqs), t), tok.pad_token_id, dtype=torch.long)
    m = torch.zeros(len(seqs), t)
    for i, (s, k) in enumerate(zip(seqs, masks)):
        x[i, : len(s)] = torch.tensor(s)
        m[i, : len(s)] = torch.tensor(k, dtype=torch.float)
    return x, m


def demonstration(rng: random.Random, r: Recipe) -> dict:
    """One supervised example; with ``mistake_fraction`` > 0 it may carry the systematic mistake
    (the answer's last character dropped) when its string is at least ``mistake_min_len`` long."""
    ws = r.warm_start
    row = tiny_task.make_row(rng, r.task)
    if ws.mistake_fraction > 0:
        draw = rng.random()  # drawn for every row so the rows do not depend on the string lengths
        if len(row["answer"]) >= ws.mistake_min_len and draw < ws.mistake_fraction:
            row = {**row, "answer": row["answer"][:-1]}
    return row


def supervised_warm_start(model, r: Recipe, tok: CharTokenizer, progress=None) -> list[float]:
    """``ws.steps`` AdamW steps of answer-only cross-entropy on freshly generated rows."""
    import torch
    import torch.nn.functional as F

    ws = r.warm_start
    rng = random.Random(r.seed * 31 + 17)  # a stream disjoint from the train/eval rows
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    sched = None
    if ws.lr_schedule == "linear":  # ws.lr at the first step, lr / steps at the last
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: max(0.0, 1.0 - k / max(1, ws.steps)))
    model.train()
    losses = []
    for step in range(ws.steps):
        x, m = _batch([demonstration(rng, r) for _ in range(ws.batch_size)], tok)
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        loss = (nll * m[:, 1:].reshape(-1)).sum() / m[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step + 1, ws.steps, losses[-1])
    model.eval()
    return losses


def ensure_warm_start(r: Recipe, progress=None) -> Path:
    """Return the warm-started model directory (``r.out``), building it when missing or stale."""
    out = r.out
    sig = json.loads(json.dumps(signature(r)))  # as it reads back from the file (tuples -> lists)
    cached = _cached_signature(out / SIGNATURE_FILE)
    if cached == sig:
        return out
    if cached is not None:
        changed = sorted(k for k in set(sig) | set(cached) if sig.get(k) != cached.get(k))
        log.info("warm start: the cached model at %s was built for different settings (%s); rebuilding",
                 out, ", ".join(changed))
    import torch

    tok = CharTokenizer(tiny_task.vocabulary(r.task))
    t0 = time.perf_counter()
    # One intra-op thread: the model is tiny (a step is ~64 x 10 tokens), and a second thread only
    # waits for a busy core. Measured on the 2-core machine with one other busy process: 0.06 s per
    # step with 1 thread, 0.44 s with torch's default 2.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            model = build_tiny_model(r, tok)
            losses = supervised_warm_start(model, r, tok, progress)
    finally:
        torch.set_num_threads(threads)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(tmp, model_vocab_size=model.config.vocab_size)
    (tmp / SIGNATURE_FILE).write_text(json.dumps({
        "sig": sig, "seconds": time.perf_counter() - t0, "final_loss": losses[-1] if losses else None}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("warm start: %d steps in %.1f s, final loss %s", len(losses), time.perf_counter() - t0,
             f"{losses[-1]:.3f}" if losses else "-")
    return out


def _cached_signature(path: Path) -> dict | None:
    """The signature of a cached build, or None when there is none or it cannot be read (a build
    that died half-way never gets here: the directory is renamed into place only when complete)."""
    try:
        return json.loads(path.read_text()).get("sig")
    except (OSError, ValueError, AttributeError):
        return None
