"""The programs users train with: HF Trainer, accelerate, PEFT (torchtitan: tests/test_torchtitan.py).

In each, ``normfuse.optimize(model)`` goes in where the model is built, before the program
wraps it; the first step's loss equals the unoptimized model's bit for bit (on CPU the fused ops
run the reference, which reproduces eager's forward rounding), the later ones are equal up to the
tolerance table (the fused backward sums the weight gradients in its own order, a last-bit
difference the optimizer carries on), and the report counts the norms.
"""

import copy
import tempfile

import pytest
import torch

import normfuse
from normfuse.zoo import hf_config
from tests.helpers import assert_close

pytest.importorskip("accelerate")
STEPS, BATCH, SEQ = 4, 4, 16


def _assert_same_losses(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    assert got[0] == want[0], (got, want)
    assert_close(torch.tensor(got), torch.tensor(want), msg=f"losses {got} vs eager {want}")


def _causal_lm(**overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config("llama", **overrides))


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _trainer_losses(model, **arguments):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Losses(TrainerCallback):
        def __init__(self):
            self.losses = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    data = [{"input_ids": ids, "labels": ids} for batch in _batches() for ids in batch]
    losses = Losses()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             logging_steps=1, learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no",
                             seed=0, data_seed=0, dataloader_num_workers=0, **arguments)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[losses]).train()
    return losses.losses


@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_trainer(checkpointing):
    torch._dynamo.reset()
    arguments = dict(gradient_checkpointing=checkpointing)
    eager = _trainer_losses(_causal_lm(), **arguments)
    model = normfuse.optimize(_causal_lm())
    _assert_same_losses(_trainer_losses(model, **arguments), eager)
    counts = normfuse.report(model).counts()
    # 5 norms, 4 fed by an add; under gradient checkpointing each layer is a region of its own and
    # keeps the sum for its recompute: the add between the layers stays outside (documented)
    assert (counts["sites"], counts["fused"], counts["not_captured"]) == (5, 5, 0)
    assert counts["fused_with_add"] == (3 if checkpointing else 4)


def test_accelerate_prepare():
    from accelerate import Accelerator

    torch._dynamo.reset()

    def losses(model):
        accelerator = Accelerator(cpu=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        out = []
        for ids in _batches():
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    model = normfuse.optimize(_causal_lm())
    _assert_same_losses(losses(model), losses(_causal_lm()))
    assert normfuse.report(model).counts()["fused_with_add"] == 4


def test_peft_lora():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch._dynamo.reset()

    def lora():
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return get_peft_model(_causal_lm(), config)

    def losses(model):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        out = []
        for ids in _batches():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    eager = losses(lora())
    model = lora()
    keys, adapter_keys = list(model.state_dict()), list(get_peft_model_state_dict(model))
    normfuse.optimize(model)
    _assert_same_losses(losses(model), eager)
    assert list(model.state_dict()) == keys and list(get_peft_model_state_dict(model)) == adapter_keys
    rep = normfuse.report(model)
    assert [s.fqn for s in rep.sites][-1] == "base_model.model.model.norm"
    assert (rep.counts()["fused"], rep.counts()["fused_with_add"]) == (5, 4)
    merged = copy.deepcopy(model).merge_and_unload()  # the adapter merges into plain linears as usual
    assert not any("lora" in key for key in merged.state_dict())
