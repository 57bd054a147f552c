"""``memory.checkpoint_blocks`` (train/models/block_checkpoint.py): with every transformer block checkpointed, the loss
and every gradient equal the run without (fp32; the built-in encoder with dropout on, a tiny Llama on padded and packed
rows through each attention path, with the chunked loss and with a LoRA adapter), the tensors saved for the backward
take fewer bytes (counted with saved_tensors_hooks, not a memory profiler), whole runs (one process, and 2 FSDP2
ranks) train the same and say it in report.json and the decisions block, ``make optimize`` proposes it only where
memory is the constraint, and a bad value is refused in one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import (
    CAUSAL_ATTENTION,
    STEPS,
    assert_clean_error,
    causal_overrides,
    causal_samples,
    global_batch,
    packed_causal_batch,
    run_cli,
    run_steps,
    spawn_run,
    synthetic_rows,
    tiny_causal_lm,
    tiny_llama,
    tiny_overrides,
    trainer_for,
    write_wndb,
)
from train.compat import fsdp2_api
from train.models.block_checkpoint import set_checkpoint_blocks
from train.models.encoder import EncoderClassifier, resolve_spec
from train.perf.memory import saved_tensor_bytes


def encoder() -> EncoderClassifier:
    torch.manual_seed(0)
    spec = resolve_spec("tiny", 50, 5, 32, 0.1, num_layers=3, hidden_size=32, num_heads=4, ffn_size=64)
    return EncoderClassifier(spec).train()  # dropout 0.1: the recomputation must draw the same masks


def encoder_batch(packed: bool) -> dict:
    if packed:
        batch = packed_causal_batch([s % 50 for s in causal_samples()])
        return {**batch, "labels": torch.tensor([0, 3, 1, 4])}
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[1, 9:] = False  # a padded sample
    return {"input_ids": torch.randint(1, 50, (4, 16), generator=g), "attention_mask": mask,
            "labels": torch.randint(0, 5, (4,), generator=g)}


def backward(model: torch.nn.Module, forward, loss_of, measure: bool = True) -> tuple[float, dict, int | None]:
    """Loss, every gradient and the bytes saved for the backward of one forward + backward (dropout seeded; None
    unless ``measure``)."""
    torch.manual_seed(7)
    saved, out = saved_tensor_bytes(forward, list(model.parameters())) if measure else (None, forward())
    loss = loss_of(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, saved


def assert_same(plain: tuple, checkpointed: tuple) -> None:
    assert checkpointed[0] == pytest.approx(plain[0], abs=1e-6, rel=1e-6)
    assert set(checkpointed[1]) == set(plain[1]) and plain[1]
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    if plain[2] is not None:  # activations: fewer bytes saved
        assert checkpointed[2] < plain[2] / 2, (checkpointed[2], plain[2])


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_encoder_checkpointed_has_the_same_loss_and_gradients_and_saves_less(packed: bool) -> None:
    batch = encoder_batch(packed)

    def run(on: bool) -> tuple:
        model = encoder()
        info = set_checkpoint_blocks(model, on)
        assert info["applied"] is on and info["blocks"] == (3 if on else 0)
        extra = {k: batch[k] for k in ("position_ids", "seq_index", "num_seqs")} if packed else {}
        return backward(model, lambda: model(batch["input_ids"], batch["attention_mask"], **extra),
                        lambda out: F.cross_entropy(out, batch["labels"]))

    assert_same(run(False), run(True))


def llama(attn: str, path: str, adapter: bool):
    from train.models.causal_probe import probe_causal_packing

    model = tiny_causal_lm("llama", attn)
    if adapter:
        pytest.importorskip("peft")
        from train.config.adapter import AdapterSettings
        from train.models.adapter import attach_adapter

        attach_adapter(model, AdapterSettings(r=4, alpha=8.0), "llama")
        with torch.no_grad():  # B off zero, so the adapter changes the logits and its A gets gradients
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    assert probe_causal_packing(model)[0]
    if path != "padded":
        model.set_packed_attention(path)
    return model.train()


OWN_MASK_UNDER_HOOKS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)
"""transformers 4.55 on torch 2.1 builds a padded batch's mask under ``vmap``, which refuses saved-tensor hooks: the
bytes are counted on the packed cases there (their mask is ours)."""
CASES = [(attn, path, False) for attn in CAUSAL_ATTENTION for path in ("padded", "sdpa-mask", "varlen", "eager-mask")
         if not (attn == "eager" and path == "eager-mask")]  # eager attention: sdpa-mask is that path
CASES.append((CAUSAL_ATTENTION[-1], "varlen", True))


@pytest.mark.parametrize("attn, path, adapter", CASES, ids=[f"{a}-{p}{'-lora' if x else ''}" for a, p, x in CASES])
def test_a_llama_checkpointed_has_the_same_loss_and_gradients_and_saves_less(attn: str, path: str,
                                                                             adapter: bool) -> None:
    """Packed rows recompute through the path their forward took (varlen's plan, eager-mask's implementation: the
    contexts have exited by the backward); LoRA needs no input gradients (non-reentrant)."""
    batch = packed_causal_batch(causal_samples())
    if path == "padded":
        batch = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}

    def run(on: bool) -> tuple:
        model = llama(attn, path, adapter)
        assert set_checkpoint_blocks(model, on)["applied"] is on
        extra = {k: batch[k] for k in ("position_ids", "seq_index")} if path != "padded" else {}
        return backward(model, lambda: model(batch["input_ids"], batch["attention_mask"], **extra),
                        lambda out: F.cross_entropy(out.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100),
                        measure=path != "padded" or OWN_MASK_UNDER_HOOKS)

    assert_same(run(False), run(True))


def test_the_trainer_steps_with_the_chunked_loss_on_packed_rows_are_unchanged() -> None:
    """Three AdamW steps of the product's trainer (chunked loss, packed rows, clipping): the same losses, pre-clip
    norms and first-step gradients checkpointed or not."""
    def run(on: bool) -> tuple:
        model = tiny_llama()
        set_checkpoint_blocks(model, on)
        return run_steps(trainer_for(model, True), [global_batch(s, True) for s in range(STEPS)])

    plain, checkpointed = run(False), run(True)
    assert [float(x) for x in checkpointed[0]] == pytest.approx([float(x) for x in plain[0]], abs=1e-6)
    assert checkpointed[1] == pytest.approx(plain[1], rel=1e-6)
    for name, grad in plain[2].items():
        torch.testing.assert_close(checkpointed[2][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_switching_off_restores_the_plain_forward_and_a_model_without_blocks_is_refused() -> None:
    from train.errors import UserError

    model = encoder()
    set_checkpoint_blocks(model, True)
    assert all("forward" in layer.__dict__ for layer in model.layers)
    info = set_checkpoint_blocks(model, False)
    assert not info["applied"] and "memory.checkpoint_blocks=false" in info["reason"]
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    with pytest.raises(UserError, match=r"^memory.checkpoint_blocks=true: model.source=python:x has no repeated") as e:
        set_checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), True, "python:x")
    assert "\n" not in str(e.value) and "set memory.checkpoint_blocks=false" in str(e.value)


def test_a_bad_value_is_refused_in_one_line_with_exit_2(tmp_path: Path) -> None:
    proc = run_cli("train", "memory.checkpoint_blocks=sometimes", f"train.output_dir={tmp_path}")
    assert_clean_error(proc, "memory.checkpoint_blocks", "set true or false")
    assert len(proc.stderr.strip().splitlines()) == 1


def final_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("type", "train") == "train" and "loss" in r]


def test_a_run_with_checkpointed_blocks_trains_as_without_and_says_so(tmp_path: Path, capsys) -> None:
    from train.config import load_config
    from train.run.training import run_training

    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    reports = {}
    for on in (False, True):
        cfg = load_config(None, tiny_overrides(wndb, tmp_path, "train.max_steps=6", "train.log_every=1",
                                               "model.num_layers=2", f"memory.checkpoint_blocks={str(on).lower()}",
                                               f"train.run_id=ck-{on}"))
        reports[on] = run_training(cfg, time.perf_counter())
    printed = capsys.readouterr().out
    assert "memory     blocks checkpointed: memory.checkpoint_blocks=true: torch.utils.checkpoint" in printed
    assert "memory     activations kept: memory.checkpoint_blocks=false" in printed
    lever = reports[True]["levers"]["checkpoint_blocks"]
    assert lever["applied"] and lever["blocks"] == 2 and "about +30% step time" in lever["reason"]
    assert not reports[False]["levers"]["checkpoint_blocks"]["applied"]
    runs = tmp_path / "runs"
    assert final_losses(runs / "ck-True") == pytest.approx(final_losses(runs / "ck-False"), abs=1e-5)
    assert len(final_losses(runs / "ck-True")) == 6


@pytest.mark.parametrize("strategy", [
    "ddp", pytest.param("fsdp", marks=pytest.mark.skipif(fsdp2_api()[0] is None, reason=fsdp2_api()[1]))])
def test_two_ranks_with_checkpointed_blocks_train_as_without(tmp_path: Path, strategy: str) -> None:
    """2 Gloo ranks, a tiny Llama on packed rows: checkpointing applied before the wrap (``fully_shard`` under fsdp)
    gives the same per-step losses as the same strategy without it."""
    wndb = write_wndb(tmp_path / "wn", synthetic_rows())
    base = causal_overrides(wndb, tmp_path, "train.max_steps=4", "train.eval_every=4", "train.log_every=1",
                            "train.checkpoint_every=4", f"dist.strategy={strategy}",
                            "model.hf_overrides={num_hidden_layers: 2, hidden_size: 32, num_attention_heads: 4, "
                            "intermediate_size: 64}")
    for on in (False, True):
        spawn_run(base + [f"memory.checkpoint_blocks={str(on).lower()}", f"train.run_id=r-{on}"])
    runs = tmp_path / "runs"
    report = json.loads((runs / "r-True" / "report.json").read_text())
    assert report["status"] == "completed" and report["env"]["distributed_strategy"] == strategy
    assert report["levers"]["checkpoint_blocks"]["applied"] and report["levers"]["checkpoint_blocks"]["blocks"] == 2
    assert "transformers' gradient checkpointing" in report["levers"]["checkpoint_blocks"]["reason"]
    assert len(final_losses(runs / "r-True")) == 4
    assert final_losses(runs / "r-True") == pytest.approx(final_losses(runs / "r-False"), abs=1e-5)


def test_optimize_proposes_block_checkpointing_only_where_memory_is_the_constraint() -> None:
    """The memory input forced: the profile's peak against the device's memory, or an arm that ran out of memory."""
    from train.config import load_config
    from train.optimize.levers import CATALOGUE
    from train.optimize.proposals import TRAINING, Candidate, Evidence, LeverContext

    lever = next(lv for lv in CATALOGUE if lv.name == "checkpoint_blocks")
    cfg = load_config(None, ["batching.max_tokens=4096"])
    roomy = Evidence(step_ms=100.0, launch_share=0.2, peak_memory_bytes=40 * 2**30, memory_total_bytes=80 * 2**30)
    full = Evidence(step_ms=100.0, launch_share=0.2, peak_memory_bytes=76 * 2**30, memory_total_bytes=80 * 2**30)
    cuda = LeverContext(cfg=cfg, device_type="cuda")
    why_not = lever.propose(cuda, roomy)
    assert isinstance(why_not, str) and why_not.startswith("memory is not the constraint (peak 50.0% of device memory, "
                                                           "no arm ran out of memory)") and "+30% step time" in why_not
    assert "peak memory not measured on this device" in lever.propose(LeverContext(cfg=cfg, device_type="cpu"),
                                                                       Evidence(step_ms=100.0))
    [c] = lever.propose(cuda, full)
    assert c.overrides == {"memory.checkpoint_blocks": True, "batching.max_tokens": 8192} and c.may_change == TRAINING
    assert c.evidence.startswith("memory is the constraint: the profiled step's peak is 95.0% of device memory")
    assert c.predicted == pytest.approx((1 / (0.8 + 0.2 / 2)) / 1.3)
    refused = Candidate("token_budget", "8192", {"batching.max_tokens": 8192}, 1.2, "per-step overhead", TRAINING)
    [c] = lever.propose(LeverContext(cfg=cfg, device_type="cpu", out_of_memory=refused), Evidence(step_ms=100.0))
    assert c.overrides == {"batching.max_tokens": 8192, "memory.checkpoint_blocks": True}
    assert "memory is the constraint: token_budget=8192 ran out of memory" in c.evidence
    assert c.predicted == pytest.approx(1.2 / 1.3)
    no_budget = lever.propose(LeverContext(cfg=load_config(None, []), device_type="cuda"), full)
    assert isinstance(no_budget, str) and "no token budget" in no_budget and "set memory.checkpoint_blocks=true" \
        in no_budget
    on = LeverContext(cfg=load_config(None, ["memory.checkpoint_blocks=true"]), device_type="cuda")
    assert lever.propose(on, full) == "already on"


def test_the_search_hands_an_out_of_memory_arm_to_the_checkpointing_lever() -> None:
    """An arm that runs out of memory makes memory the constraint: the next ranking proposes it again with every
    block checkpointed, and says why."""
    from train.config import RunConfig
    from train.optimize.levers import CATALOGUE
    from train.optimize.proposals import TRAINING, Candidate, Evidence, Lever, LeverContext
    from train.optimize.search import search
    from train.optimize.settings import SearchSettings

    class OutOfMemory:
        device = torch.device("cpu")

        def context(self, settings: dict) -> LeverContext:
            return LeverContext(cfg=RunConfig(), device_type="cpu")

        def profile(self, settings: dict, index: int) -> Evidence:
            return Evidence(step_ms=5.0)

        def arm(self, name: str, settings: dict):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

        def schedule(self, settings: dict) -> dict:
            return {}

    big = Lever("token_budget", "fake", "anywhere", "none", TRAINING, lambda ctx, ev: [
        Candidate("token_budget", "8192", {"batching.max_tokens": 8192}, 1.6, "per-step overhead", TRAINING)])
    ckpt = next(lv for lv in CATALOGUE if lv.name == "checkpoint_blocks")
    res = search(OutOfMemory(), (big, ckpt), {}, SearchSettings(budget_s=60.0, rounds=3, window_samples=8,
                                                                 min_gain=1.05, quality_tolerance=0.05,
                                                                 arm_timeout_s=10.0, confirm_rounds=3),
                 notice=lambda _m: None)
    assert [d.candidate.lever for d in res.decisions] == ["token_budget", "checkpoint_blocks"]
    assert all(d.reason.startswith("out of memory") for d in res.decisions)
    again = res.decisions[1].candidate
    assert again.overrides == {"batching.max_tokens": 8192, "memory.checkpoint_blocks": True}
    assert "memory is the constraint: token_budget=8192 ran out of memory" in again.evidence
    assert res.rankings[0][0]["lever"] == "token_budget" and len(res.rankings[0]) == 1  # not proposed before
