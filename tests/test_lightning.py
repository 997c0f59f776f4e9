"""The Lightning callback (gradstore.integrations.lightning) under the real `lightning.pytorch.Trainer` on the CPU: a
tiny LightningModule, a few optimizer steps with gradient accumulation and clipping by norm, alone and under DDP
(strategy 'ddp_fork', 2 gloo ranks on 127.0.0.1).

What is expected comes from Lightning itself (its CSVLogger's metrics.csv, `trainer.callback_metrics`) and from
the test's own reads of `p.grad` with torch (before Lightning's clipping, in on_before_optimizer_step, and after
the optimizer step, from a torch optimizer step hook), never from gradstore.
"""

from __future__ import annotations

import glob
import json
import math
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
import pandas as pd  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

import gradstore  # noqa: E402
from gradstore.integrations.lightning import GradstoreCallback  # noqa: E402

CLIP = 0.5


class Net(pl.LightningModule):
    """Linear(4, 8), tanh, Linear(8, 1) on a squared error; the test's own eyes on `.grad` are built in: norms
    before clipping (on_before_optimizer_step) and when the SGD step returns (SGD leaves `.grad` as it got it)."""

    def __init__(self, nan_at_step: int | None = None, fail_at_batch: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 1)
        self.nan_at_step, self.fail_at_batch = nan_at_step, fail_at_batch
        self.before_clip: list[dict[str, float]] = []
        self.stepped: list[dict[str, float]] = []
        self.metrics: list[float] = []

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at_batch:
            raise ZeroDivisionError("the step failed")
        x, y = batch
        if self.nan_at_step == self.trainer.global_step:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = (self(x) - y).pow(2).mean()
        self.log("train_loss", loss)
        return loss

    def _norms(self) -> dict[str, float]:
        return {n: float(p.grad.double().norm()) for n, p in self.named_parameters() if p.grad is not None}

    def on_before_optimizer_step(self, optimizer):
        self.before_clip.append(self._norms())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step > len(self.metrics):  # the optimizer stepped in this batch
            self.metrics.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        opt.register_step_post_hook(lambda o, a, k: self.stepped.append(self._norms()))
        return opt


def _loader(n: int = 24):
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(callback, **kw) -> pl.Trainer:
    base = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pl.Trainer(**base)


def test_steps_passes_values_and_final_gradients_match_lightning(tmp_path):
    db = str(tmp_path / "lit.db")
    callback = GradstoreCallback("lit", db=db)
    net = Net()
    trainer = _trainer(callback, logger=CSVLogger(str(tmp_path / "logs")), log_every_n_steps=1)
    trainer.fit(net, _loader())
    store = gradstore.open(db)
    steps = store.steps("lit")
    assert list(steps["step"]) == [0, 1, 2] == list(range(trainer.global_step))
    assert list(steps["passes"]) == [2, 2, 2] and set(steps["status"]) == {"ok"}  # 2 micro-batches each
    values = store.values("lit")
    logged = pd.read_csv(glob.glob(str(tmp_path / "logs" / "**" / "metrics.csv"), recursive=True)[0])
    assert list(logged["step"]) == [0, 1, 2]
    assert list(values["train_loss"]) == pytest.approx(list(logged["train_loss"]), rel=1e-6)
    assert list(values["train_loss"]) == pytest.approx(net.metrics, rel=1e-12)  # trainer.callback_metrics
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(values["train_loss"].iloc[-1], rel=1e-12)
    assert list(values["global_step"]) == [1, 2, 3] and list(values["lr"]) == [0.1] * 3
    grads = store.param_grads("lit", which="all")
    for step in range(3):
        before, after = net.before_clip[step], net.stepped[step]
        total = math.sqrt(sum(v * v for v in before.values()))
        # gradstore's own observation of Lightning's clipping: the total norm it clipped with
        assert values.loc[(step, 0), "clip_grad_norm"] == pytest.approx(total, rel=1e-6)
        assert total > CLIP  # the test clips for real
        rows = grads[grads["step"] == step]
        at_pass = rows[rows["final"] == 0].set_index("param")["norm"]
        final = rows[rows["final"] == 1].set_index("param")["norm"]
        for name in before:
            assert at_pass[name] == pytest.approx(before[name], rel=1e-6)  # what the hooks saw: before clipping
            assert final[name] == pytest.approx(after[name], rel=1e-6)  # what the optimizer used: clipped
            assert final[name] == pytest.approx(before[name] * CLIP / (total + 1e-6), rel=1e-5)
    assert callback.recorder.last_step.step == 2
    assert store.runs().set_index("run").loc["lit", "status"] == "finished"


def test_an_exception_in_fit_ends_the_recording_with_error(tmp_path):
    db = str(tmp_path / "err.db")
    callback = GradstoreCallback("lit-err", db=db)
    with pytest.raises(ZeroDivisionError):
        _trainer(callback).fit(Net(fail_at_batch=3), _loader())
    store = gradstore.open(db)
    steps = store.steps("lit-err")
    assert list(steps["step"]) == [0, 1] and list(steps["status"]) == ["ok", "error"]
    assert "the step failed" in steps["error"].iloc[-1]
    assert store.runs().set_index("run").loc["lit-err", "status"] == "error"
    with gradstore.record("after", db=db):  # the callback's scope is closed: a new one may open (scopes never nest)
        pass


def test_flight_recorder_through_the_callback_dumps_at_the_first_nan(tmp_path):
    db = str(tmp_path / "flight.db")
    callback = GradstoreCallback("lit-flight", db=db, keep=2)
    _trainer(callback, max_steps=5, gradient_clip_val=None).fit(Net(nan_at_step=3), _loader(40))
    store = gradstore.open(db)
    steps = store.steps("lit-flight").set_index("step")
    assert list(steps["level"]) == ["summary", "summary", "full", "full", "summary"]
    assert list(steps["status"]) == ["ok", "ok", "ok", "nonfinite", "nonfinite"]
    dumps = store.dumps("lit-flight")
    assert list(zip(dumps["step"], dumps["reason"], dumps["first_step"], dumps["last_step"])) == [
        (3, "nonfinite", 2, 3)
    ]
    assert set(store.passes("lit-flight")["step"]) == {2, 3}
    assert list(store.first_nonfinite("lit-flight")["step"]) == [3]


# ---- DDP: strategy ddp_fork, two ranks, each recording its own steps --------------------------------------------
class RankNet(Net):
    """Net whose every rank writes what it saw (callback_metrics, .grad norms) to a JSON file of its own."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_end(self):
        with open(f"{self.out}/rank{self.global_rank}.json", "w") as f:
            json.dump({"metrics": self.metrics, "stepped": self.stepped, "world": self.trainer.world_size}, f)


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo is not available")
def test_ddp_two_ranks_each_record_their_steps(tmp_path):
    import torch._dynamo  # noqa: F401 - DDP imports it: once here, not in each forked rank

    db = str(tmp_path / "ddp.db")
    callback = GradstoreCallback("lit-ddp", db=db)
    trainer = _trainer(callback, devices=2, strategy="ddp_fork", max_steps=2)
    trainer.fit(RankNet(str(tmp_path)), _loader(32))
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["world"] for s in seen] == [2, 2]
    store = gradstore.open(db)
    steps = store.steps("lit-ddp")
    assert sorted(zip(steps["rank"], steps["step"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert set(steps["passes"]) == {2} and set(steps["status"]) == {"ok"}
    assert store.runs().set_index("run").loc["lit-ddp", "world_size"] == 2
    values = store.values("lit-ddp")
    for rank, s in enumerate(seen):
        assert [values.loc[(step, rank), "train_loss"] for step in (0, 1)] == pytest.approx(s["metrics"], rel=1e-12)
        final = store.param_grads("lit-ddp", rank=rank)
        for step, norms in enumerate(s["stepped"]):
            got = final[final["step"] == step].set_index("param")["norm"]
            for name, norm in norms.items():
                assert got[name] == pytest.approx(norm, rel=1e-6)
    assert seen[0]["metrics"] != seen[1]["metrics"]  # each rank's own batches
    assert store.rank_divergence("lit-ddp").empty  # after DDP's all-reduce the ranks' gradients agree bitwise
