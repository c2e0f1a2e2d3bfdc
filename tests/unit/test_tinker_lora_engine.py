"""The multi-LoRA engine: a batched pass over several adapters equals separate passes, adapters
learn only from their own rows and own optimizer, checkpoints are PEFT-exact, and the scheduler
batches different adapters' forward_backward requests into one pass."""

from __future__ import annotations

import string

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from backends.tinker.lora_engine import DatumIn, EngineError, LoraEngine, WorkItem

SEQ = [7, 20, 11, 33, 9, 25, 14, 30, 8, 19]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from backends.models.loading import save_hf
    from backends.models.tiny import build_tiny_model
    from backends.models.tokenizer import build_char_tokenizer
    from skyrl_contracts.schema import TinyModelInit

    tokenizer = build_char_tokenizer(string.digits + string.ascii_lowercase + " +-*=?.,")
    model = build_tiny_model(TinyModelInit(hidden_size=32, layers=1, heads=2, intermediate_size=64), tokenizer, 0)
    return save_hf(model, tokenizer, tmp_path_factory.mktemp("m") / "model")


def ce(seq, weights=None):
    n = len(seq) - 1
    return DatumIn(
        seq[:-1], seq[1:], {"weights": np.asarray(weights if weights is not None else [1.0] * n, np.float32)}
    )


def grads(engine, model_id):
    return [p.grad.clone() if p.grad is not None else None for p in engine.adapter(model_id).parameters()]


def test_batched_pass_equals_separate_passes_and_gradients_stay_per_adapter(model_dir):
    engine = LoraEngine(model_dir, max_rank=8, max_adapters=4)
    mods = engine.modules_for(True, True, True)
    for name, seed in (("a", 1), ("b", 2)):
        engine.create_adapter(name, 4, mods, seed)
        for _, b in engine.adapter(name).weights.values():  # B != 0 so that adapters differ
            torch.nn.init.normal_(b, std=0.1, generator=torch.Generator().manual_seed(seed))
    short = [9, 3, 12, 5]
    alone_a = engine.run([WorkItem("a", [ce(SEQ)], "cross_entropy", {})], with_grad=True)[0]
    ga = grads(engine, "a")
    alone_b = engine.run([WorkItem("b", [ce(short)], "cross_entropy", {})], with_grad=True)[0]
    gb = grads(engine, "b")
    for name in ("a", "b"):
        for p in engine.adapter(name).parameters():
            p.grad = None
    both = engine.run(
        [WorkItem("a", [ce(SEQ)], "cross_entropy", {}), WorkItem("b", [ce(short)], "cross_entropy", {})], True
    )
    assert both[0].loss_sum == pytest.approx(alone_a.loss_sum, rel=1e-5)
    assert both[1].loss_sum == pytest.approx(alone_b.loss_sum, rel=1e-5)
    np.testing.assert_allclose(both[1].logprobs[0], alone_b.logprobs[0], rtol=1e-5, atol=1e-6)
    for g1, g2 in zip(grads(engine, "a"), ga):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)
    for g1, g2 in zip(grads(engine, "b"), gb):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)

    # an optimizer step (with weight decay) of one adapter never touches the other
    before_b = [p.detach().clone() for p in engine.adapter("b").parameters()]
    engine.optim_step("a", 1e-2, weight_decay=0.1, grad_clip_norm=0.5)
    assert all(torch.equal(p, q) for p, q in zip(engine.adapter("b").parameters(), before_b))
    assert all(p.grad is None for p in engine.adapter("a").parameters())
    assert any(p.grad is not None for p in engine.adapter("b").parameters())  # b's gradient still accumulates

    # forward-only leaves gradients alone
    engine.run([WorkItem("b", [ce(short)], "cross_entropy", {})], with_grad=False)
    for g1, g2 in zip(grads(engine, "b"), gb):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-6)


def test_rows_of_adapters_interleaved_by_length_each_get_their_own_adapter(model_dir):
    # lengths 9 (a), 6 (b), 4 (a): sorted longest first the adapters interleave; b trains no MLP
    engine = LoraEngine(model_dir, max_rank=8, max_adapters=4)
    engine.create_adapter("a", 4, engine.modules_for(True, True, True), 1)
    engine.create_adapter("b", 4, engine.modules_for(True, False, False), 2)
    for name in ("a", "b"):
        for _, b in engine.adapter(name).weights.values():
            torch.nn.init.normal_(b, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    a_data, b_data = [ce(SEQ), ce(SEQ[:5])], [ce(SEQ[2:9])]
    alone = [engine.run([WorkItem(m, d, "cross_entropy", {})], False)[0] for m, d in (("a", a_data), ("b", b_data))]
    both = engine.run([WorkItem("a", a_data, "cross_entropy", {}), WorkItem("b", b_data, "cross_entropy", {})], False)
    for together, single in zip(both, alone):
        for x, y in zip(together.logprobs, single.logprobs):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_micro_batches_sum_like_one_pass(model_dir):
    engine = LoraEngine(model_dir, max_rank=8, max_adapters=2, max_batch_tokens=12)
    engine.create_adapter("a", 4, engine.modules_for(True, False, False), 0)
    data = [ce(SEQ), ce(SEQ[:5]), ce(SEQ[2:9])]
    small = engine.run([WorkItem("a", data, "cross_entropy", {})], False)[0]
    engine.max_batch_tokens = 10_000
    large = engine.run([WorkItem("a", data, "cross_entropy", {})], False)[0]
    assert small.loss_sum == pytest.approx(large.loss_sum, rel=1e-5)
    assert [len(x) for x in small.logprobs] == [9, 4, 6]


def test_training_lowers_the_loss_and_checkpoints_are_peft_exact(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = LoraEngine(model_dir, max_rank=8, max_adapters=3)
    engine.create_adapter("a", 8, engine.modules_for(True, True, True), 0)
    first = None
    for _ in range(25):
        res = engine.run([WorkItem("a", [ce(SEQ)], "cross_entropy", {})], True)[0]
        first = first if first is not None else res.loss_sum
        engine.optim_step("a", 1e-2, eps=1e-8)
    last = engine.run([WorkItem("a", [ce(SEQ)], "cross_entropy", {})], False)[0].loss_sum
    assert last < 0.5 * first

    engine.save("a", tmp_path / "ck", with_optimizer=True)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "ck").eval()
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([SEQ[:-1]])).logits
    lp = torch.log_softmax(logits, -1)[0].gather(-1, torch.tensor(SEQ[1:]).unsqueeze(-1)).sum().item()
    assert -lp == pytest.approx(last, rel=1e-4)

    engine.load("c", tmp_path / "ck", with_optimizer=True)
    assert engine.run([WorkItem("c", [ce(SEQ)], "cross_entropy", {})], False)[0].loss_sum == pytest.approx(
        last, rel=1e-6
    )
    # the optimizer state came along: the same step from a and from c gives the same weights
    for name in ("a", "c"):
        engine.run([WorkItem(name, [ce(SEQ)], "cross_entropy", {})], True)
        engine.optim_step(name, 1e-2, eps=1e-8)
    for p, q in zip(engine.adapter("a").parameters(), engine.adapter("c").parameters()):
        torch.testing.assert_close(p, q)
    engine.create_adapter("d", 4, ["q_proj"])
    with pytest.raises(EngineError, match="slots"):
        engine.create_adapter("e", 4, ["q_proj"])
    with pytest.raises(EngineError, match="rank 16"):
        engine.create_adapter("a", 16, ["q_proj"])


def test_scheduler_batches_adapters_and_keeps_seq_order(model_dir, tmp_path):
    from backends.tinker.protocol import AdamParams, OptimStepRequest
    from backends.tinker.service import Job, ServerConfig, TinkerService
    from backends.tinker.wire import Datum, ForwardBackward

    config = ServerConfig(
        base_model="tiny", model_dir=str(model_dir), storage_dir=str(tmp_path / "st"), api_keys=frozenset({"tml-a"})
    )
    service = TinkerService(config)
    trainer = service.scheduler
    trainer.engine = LoraEngine(model_dir, 8, 4)
    for m in ("m1", "m2", "m3"):
        trainer.engine.create_adapter(m, 4, ["q_proj", "v_proj"], 0)

    def fb(model, seq_id):
        d = Datum(
            SEQ[:-1], {"target_tokens": np.asarray(SEQ[1:], np.int64), "weights": np.ones(len(SEQ) - 1, np.float32)}
        )
        rid, _ = service.store.submit("o", "forward_backward", None, model_id=model, seq_id=seq_id)
        return Job(
            rid, "forward_backward", "o", model, seq_id, ForwardBackward(model, seq_id, "cross_entropy", False, [d])
        )

    # m1 sends seq 2 before seq 1 (chunks, first chunk last); m2 and m3 one request each
    jobs = [fb("m1", 2), fb("m2", 1), fb("m3", 1)]
    for job in jobs:
        trainer.submit(job)
    rounds = trainer._take_round()
    assert [[(j.model_id, j.seq_id) for j in g] for g in rounds] == [[("m2", 1), ("m3", 1)]]  # m1 waits for seq 1
    trainer.submit(fb("m1", 1))
    rid, _ = service.store.submit("o", "optim_step", None, model_id="m1", seq_id=3)
    trainer.submit(
        Job(rid, "optim_step", "o", "m1", 3, OptimStepRequest(model_id="m1", seq_id=3, adam_params=AdamParams()))
    )
    rounds = trainer._take_round()
    assert [[(j.model_id, j.seq_id) for j in g] for g in rounds] == [[("m1", 1), ("m1", 2)]]
    trainer._execute(rounds)
    assert trainer.batch_sizes[-1] == 1
    rounds = trainer._take_round()
    assert [[(j.model_id, j.seq_id) for j in g] for g in rounds] == [[("m1", 3)]]
    trainer._execute(rounds)
    assert service.store.future(rid).status == "done"
    service.store.close()
