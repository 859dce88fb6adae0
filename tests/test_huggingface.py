"""The Hugging Face stack on tpu: the Trainer with its default arguments, Accelerate."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")
accelerate = pytest.importorskip("accelerate", reason="the test extra installs accelerate")


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, length=12):
        from torchtpu.zoo import VOCAB

        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, VOCAB, (n, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _tiny_llama():
    """The zoo's tiny Llama, with fresh random weights."""
    from torchtpu.zoo import ARCHS

    (llama,) = [arch for arch in ARCHS if arch.name == "llama"]
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama.build_config())


def _reset_accelerate():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def _train(tmp_path, device: str):
    _reset_accelerate()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / device),
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        seed=0,
        save_strategy="no",
        use_cpu=device == "cpu",
    )  # everything else as it comes: pinned memory, AdamW, a linear schedule
    trainer = transformers.Trainer(
        model=_tiny_llama(), args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(8)
    )
    assert args.device.type == device
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evaluation = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(tmp_path / device / "model"))
    return trainer.model, losses, evaluation


def test_trainer_with_its_defaults_trains_like_the_cpu(tmp_path):
    _, cpu_losses, cpu_eval = _train(tmp_path, "cpu")
    model, losses, evaluation = _train(tmp_path, "tpu")
    assert next(model.parameters()).device.type == "tpu"
    assert len(losses) == len(cpu_losses) == 4
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(evaluation, cpu_eval, rtol=1e-5, atol=1e-5)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "tpu" / "model"))
    for (name, saved), trained in zip(reloaded.state_dict().items(), model.state_dict().values()):
        assert torch.equal(saved, trained.cpu()), name


def test_accelerate_picks_the_tpu_device_and_prepares_a_loop():
    _reset_accelerate()
    accelerator = accelerate.Accelerator()
    assert accelerator.device.type == "tpu"
    model = _tiny_llama()
    cpu_model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cpu_optimizer = torch.optim.AdamW(cpu_model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_Tokens(8), batch_size=4, pin_memory=True)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    assert next(model.parameters()).device.type == "tpu"
    for batch, cpu_batch in zip(prepared, torch.utils.data.DataLoader(_Tokens(8), batch_size=4)):
        assert batch["input_ids"].device.type == "tpu"
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        cpu_loss = cpu_model(**cpu_batch).loss
        cpu_loss.backward()
        cpu_optimizer.step()
        cpu_optimizer.zero_grad()
        torch.testing.assert_close(loss.item(), cpu_loss.item(), rtol=1e-5, atol=1e-5)
    _reset_accelerate()


def _lora(model):
    peft = pytest.importorskip("peft", reason="the test extra installs peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def test_lora_fine_tune_and_merge_match_the_cpu():
    results = []
    for device in ("cpu", "tpu"):
        model = _lora(_tiny_llama()).to(device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert 0 < len(trainable) < len(list(model.parameters()))
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        losses = []
        for batch in torch.utils.data.DataLoader(_Tokens(8), batch_size=4):
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        merged = model.merge_and_unload()
        logits = merged(input_ids=_Tokens(2).ids.to(device)).logits.detach().cpu()
        results.append((losses, logits))
    (cpu_losses, cpu_logits), (losses, logits) = results
    torch.testing.assert_close(losses, cpu_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, cpu_logits, rtol=1e-5, atol=1e-5)


def test_trainer_trains_a_lora_adapter_on_tpu(tmp_path):
    _reset_accelerate()
    model = _lora(_tiny_llama())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, report_to="none",
        save_strategy="no", learning_rate=1e-2,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    assert next(model.parameters()).device.type == "tpu"
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach().cpu(), frozen[name]), name
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.detach().abs().sum().item() > 0 for p in lora_b)  # trained from 0


def _bfloat16_llama_and_tokens():
    model = _tiny_llama().to(torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    return model, torch.randint(0, model.config.vocab_size, (2, 24), generator=generator)


def test_the_causal_lm_loss_keeps_the_16_bit_logits_not_their_float32_copy():
    """Transformers' ``ForCausalLMLoss`` upcasts the logits before ``cross_entropy``:
    after the forward only the model's bfloat16 logits stay alive for the backward
    (Note [Saving the logits' values]), and the gradients are the CPU's."""
    import jax

    model, ids = _bfloat16_llama_and_tokens()
    grads = {}
    for device in ("cpu", "tpu"):
        model.zero_grad()
        model.to(device)
        before = {id(a): a for a in jax.live_arrays()}  # held: ids stay theirs
        out = model(input_ids=ids.to(device), labels=ids.to(device))
        if device == "tpu":
            out.loss.item()  # the forward has run
            size = ids.numel() * model.config.vocab_size
            made = [a for a in jax.live_arrays() if id(a) not in before and a.size == size]
            assert sorted(str(a.dtype) for a in made) == ["bfloat16"], made
        out.loss.backward()
        grads[device] = model.lm_head.weight.grad.float().cpu()
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=2e-2, atol=2e-3)


def test_a_compiled_causal_lm_keeps_the_16_bit_logits_for_its_loss(forward_graph_outputs):
    """Under ``torch.compile`` the forward graph keeps the bfloat16 logits for the
    loss's backward, not ``ForCausalLMLoss``'s float32 copy (Note [A compiled loss of
    upcast logits]); the gradients are the CPU's."""
    kept = forward_graph_outputs
    torch._dynamo.reset()
    model, ids = _bfloat16_llama_and_tokens()
    grads = {}
    for device in ("cpu", "tpu"):
        model.zero_grad()
        model.to(device)
        run = torch.compile(model, backend="tpu") if device == "tpu" else model
        run(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
        grads[device] = model.lm_head.weight.grad.float().cpu()
    vocab = model.config.vocab_size
    logits = [v.dtype for v in kept if v.dim() >= 2 and v.shape[-1] == vocab]
    assert logits and set(logits) == {torch.bfloat16}, logits
    torch.testing.assert_close(grads["tpu"], grads["cpu"], rtol=2e-2, atol=2e-3)
