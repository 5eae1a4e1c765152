"""Fine-tuning the emitted model further (issue 23): gradient checkpointing, reentrant and not, gives
the gradients of the run without it (depth 1, head_rank 2, a position table; one domain and mixed rows),
and a short Trainer run works on the loaded model and saves a directory that loads again."""

import pytest
import torch

from test_compiled import PROMPTS, build_darts_dir
from test_modeling import load, tokenizer_for


@pytest.fixture(scope="module")
def darts(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("training") / "darts")
    build_darts_dir(path, depth=1)
    batch = tokenizer_for(path)(PROMPTS, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    return {"path": path, "batch": {**batch, "labels": labels}}


def gradients(path, batch, domain, checkpointing):
    model = load(path, trust_remote_code=True)
    model.train()  # dropout is 0 in these configs: train mode only switches checkpointing on
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": checkpointing})
    loss = model(**batch, darts_domain=domain, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("domain", ["code", ["math", "none", "code", "math"]], ids=["one domain", "mixed rows"])
def test_gradient_checkpointing_gives_the_gradients_without_it(darts, domain):
    loss, expected = gradients(darts["path"], darts["batch"], domain, None)
    adapter = "darts.code.blocks.1.self_attn.q_proj.up.weight"
    assert expected[adapter] is not None and expected[adapter].abs().max() > 0
    assert expected["model.layers.1.self_attn.q_proj.weight"].abs().max() > 0
    for reentrant in (True, False):
        checkpointed_loss, got = gradients(darts["path"], darts["batch"], domain, reentrant)
        torch.testing.assert_close(checkpointed_loss, loss, rtol=0, atol=0)
        for name, grad in expected.items():
            if grad is None:
                assert got[name] is None, (reentrant, name)
            else:  # the recompute repeats the same float32 ops: only summation order could differ
                torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=f"{reentrant} {name}")


def test_trainer_fine_tunes_the_loaded_model(darts, tmp_path):
    """transformers' Trainer (gradient checkpointing on) fine-tunes the repaired merge with its default
    domain active: the loss is finite, the merged weights and the correction both move, and the saved
    directory loads again with remote code and gives the fine-tuned model's logits."""
    from transformers import Trainer, TrainingArguments

    model = load(darts["path"], trust_remote_code=True)
    tokenizer = tokenizer_for(darts["path"])
    rows = [{key: value[i] for key, value in darts["batch"].items()} for i in range(len(PROMPTS))]
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    arguments = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2,
                                  learning_rate=1e-2, activation_checkpointing=True, report_to=[], save_strategy="no",
                                  logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=arguments, train_dataset=rows)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = {name for name, param in model.named_parameters() if not torch.equal(param.detach(), before[name])}
    assert "model.layers.0.mlp.up_proj.weight" in moved and "darts.math.up.weight" in moved
    assert "darts.math.blocks.1.mlp.down_proj.up.weight" in moved  # trained through the checkpointed block
    assert "darts.code.up.weight" not in moved  # a domain the batches never used
    model.eval()
    model.save_pretrained(tmp_path / "tuned")
    tokenizer.save_pretrained(tmp_path / "tuned")
    reloaded = load(str(tmp_path / "tuned"), trust_remote_code=True)
    inputs = {key: value for key, value in darts["batch"].items() if key != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-5)
