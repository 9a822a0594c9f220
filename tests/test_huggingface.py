"""Hugging Face models as they come: transformers' GPT-2 and Llama built from tiny configs, a
peft LoRA adapter and transformers.Trainer (no downloads; skipped without the ``hf`` extra)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import sgrld  # noqa: E402
from sgrld.integrations.huggingface import TrainerWatch  # noqa: E402

VOCAB = 32


def gpt2(attn: str = "eager", seed: int = 0) -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=16,
        bos_token_id=0, eos_token_id=0, attn_implementation=attn, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def llama(attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
        intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, attn_implementation=attn,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def sampler(lr: float = 1e-3) -> sgrld.Sampler:
    return sgrld.build("identity", lr=lr, num_data=1000, noise="philox")


def lm_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss


def batch(k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (k, 3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, 0, -2:] = 0  # a padded sequence
    return ids, mask


def test_chains_call_returns_each_chains_model_output():
    chains = sgrld.Chains(lambda s: gpt2(seed=s), sampler(), seeds=[0, 1, 2], chain_batch=2)
    ids, _ = batch(3)
    out = chains.eval()(ids)  # a ModelOutput, run without a key-value cache
    assert out.logits.shape == (3, 3, 6, VOCAB)
    for k in range(3):
        with torch.no_grad():
            alone = chains.module(k).eval()(ids[k], use_cache=False).logits
        torch.testing.assert_close(out.logits[k], alone, rtol=1e-5, atol=1e-5)


def test_padded_batch_eager_steps_as_sequential_and_sdpa_says_what_to_do():
    ids, mask = batch()
    chains = sgrld.Chains(gpt2("eager"), sampler(), seeds=[0, 1])
    losses = chains.step(lm_loss, ids, mask)
    for k in range(2):
        with torch.no_grad():
            alone = lm_loss(gpt2("eager"), ids[k], mask[k])
        torch.testing.assert_close(losses[k], alone, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match=r"attn_implementation='eager'.*vectorize=False"):
        sgrld.Chains(llama("sdpa"), sampler(), seeds=[0, 1]).step(lm_loss, ids, mask)


def test_no_batching_rule_note_is_shown_once():
    ids, _ = batch()
    chains = sgrld.Chains(llama("sdpa"), sampler(), seeds=[0, 1])

    def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    with pytest.warns(UserWarning, match="no batching rule for .*shown once"):
        chains.step(loss, ids)
    chains.step(loss, ids)  # warnings are errors here: none the second time


def test_llc_masks_keyed_by_name_equal_masks_keyed_by_parameter():
    model = gpt2()
    name = "transformer.h.0.mlp.c_fc.weight"
    param = dict(model.named_parameters())[name]
    mask = torch.zeros_like(param, dtype=torch.bool)
    mask[:4] = True
    ids, attention = batch(1)
    loader = [(ids[0], attention[0])]

    def loss(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return lm_loss(m, *b)

    common = dict(num_data=100, num_chains=2, num_steps=4, lr=1e-4, warn=False)  # no verdict
    by_name = sgrld.llc(model, loss, loader, masks={name: mask}, **common)
    by_param = sgrld.llc(model, loss, loader, masks={param: mask}, **common)
    assert by_name.trace.tolist() == by_param.trace.tolist()
    with pytest.raises(ValueError, match="no parameter named 'nope'"):
        sgrld.llc(model, loss, loader, masks={"nope": mask}, **common)


def test_peft_lora_chains_sample_the_adapter_only():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with warnings.catch_warnings():  # peft's use of a name transformers has deprecated
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(llama("eager"), config)
    chains = sgrld.Chains(model, sampler(1e-2), seeds=[0, 1], sample=lambda n: "lora_" in n)
    assert chains.params and all("lora_" in n for n in chains.params)
    before = {n: p.clone() for n, p in chains.params.items()}
    ids, mask = batch()
    chains.step(lm_loss, ids, mask)
    assert all(not torch.equal(before[n], p) for n, p in chains.params.items())
    first = chains.params[next(iter(before))]
    assert not torch.equal(first[0], first[1])  # each chain its own noise


def test_log_predictive_density_of_a_language_model():
    model = gpt2()
    store = sgrld.SampleStore()
    store.add({k: v.clone() for k, v in model.state_dict().items()})
    ids, mask = batch(1)
    ids = ids[0]
    labels = ids.masked_fill(mask[0] == 0, -100)  # padding left out, as transformers' labels
    lp = sgrld.log_predictive_density(model, store, ids, labels, next_token=True)
    with torch.no_grad():
        expected = -model(input_ids=ids, labels=labels, use_cache=False).loss
    assert lp == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match="targets must have shape"):
        sgrld.log_predictive_density(model, store, ids, labels[:, :3], next_token=True)


def _train(tmp_path, **arguments: object) -> None:
    model = gpt2()
    ids, mask = batch(1)
    pairs = zip(ids[0], mask[0], strict=True)
    data = [{"input_ids": i, "attention_mask": m, "labels": i} for i, m in pairs]
    optimizer = sgrld.SGLD(model.parameters(), lr=1e-2, num_data=len(data))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=3, report_to=[],
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True, **arguments,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, optimizers=(optimizer, None)
    )
    trainer.train()


def test_trainer_defaults_are_warned_once_and_the_recipe_is_quiet(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(tmp_path)
    ours = [str(w.message) for w in caught if str(w.message).startswith("sgrld:")]
    assert len(ours) == 2, ours
    assert any("changed ℓ" in m and "lr_scheduler_type='constant'" in m for m in ours)
    assert any("clipped the gradient's norm" in m and "max_grad_norm=0" in m for m in ours)
    _train(tmp_path, lr_scheduler_type="constant", max_grad_norm=0.0)  # warnings are errors


def test_trainer_watch_is_quiet_outside_a_trainer():
    w = torch.zeros(2, requires_grad=True)
    optimizer = sgrld.SGLD([w], lr=1e-3, num_data=10)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(3):  # a scheduler of the user's own: no warning (they are errors here)
        w.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    hooks = list(optimizer._optimizer_step_pre_hooks.values())
    assert any(isinstance(h, TrainerWatch) and h.active is False for h in hooks)


def test_the_guides_first_example_runs():
    """docs/huggingface.md's many-chains block, as shown."""
    import re
    from pathlib import Path

    page = Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"
    block = re.search(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    assert block is not None
    namespace: dict[str, object] = {}
    exec(compile(block.group(1), str(page), "exec"), namespace)
    assert namespace["logits"].shape == (4, 8, 16, 1000)  # type: ignore[attr-defined]
