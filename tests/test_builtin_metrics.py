"""Built-in metrics: merged over unequal ranks == one process on the whole batch (merged by
the service's engine, without Ray: ``helpers.LocalService``)."""

import math
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from metricsvc.client import MetricClient
from metricsvc.client.metrics import (
    estimate_flops,
    record_advantage_signs,
    record_logp_diagnostics,
    record_moe_balance,
    record_train_perf,
    validation_metrics,
)
from metricsvc.core.records import COUNT, SUM
from tests.helpers import LocalService

WORLD = 4
P, R = 5, 7  # prompt and response widths


def make_batch(seed, rows, all_wrong=False):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, P + 1, (rows,), generator=g)
    prompt_len[0] = P  # at least one clipped prompt somewhere
    resp_len = torch.randint(1, R + 1, (rows,), generator=g)
    prompt_mask = torch.arange(P)[None, :] >= (P - prompt_len)[:, None]  # left padded
    resp_mask = torch.arange(R)[None, :] < resp_len[:, None]
    garbage = torch.full((rows, R), float("nan"))
    scores = torch.where(resp_mask, torch.rand(rows, R, generator=g) * 0.3, garbage)
    scores = torch.nan_to_num(scores, nan=0.0)  # scores are 0 beyond the response, as in verl
    if all_wrong:
        scores = scores * 0.0
    rewards = scores - 0.01
    return {
        "responses": torch.zeros(rows, R, dtype=torch.long),
        "attention_mask": torch.cat([prompt_mask, resp_mask], dim=1).long(),
        "response_mask": resp_mask.long(),
        "token_level_scores": scores,
        "token_level_rewards": rewards,
        "advantages": torch.where(resp_mask, torch.randn(rows, R, generator=g), garbage),
        "returns": torch.where(resp_mask, torch.randn(rows, R, generator=g) * 2 + 1, garbage),
        "values": torch.where(resp_mask, torch.randn(rows, R, generator=g), garbage),
        "num_turns": torch.randint(1, 4, (rows,), generator=g),
    }


def concat(batches):
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def run_ranks(service, per_rank_calls):
    """Run one step: rank ``r`` makes the calls ``per_rank_calls[r]`` (``(a client method's
    name, or a built-in recorder ``f(client, ...)``, args, kwargs)``) and closes it."""
    clients = service.clients(len(per_rank_calls))
    for client, calls in zip(clients, per_rank_calls):
        for call, args, kwargs in calls:
            target = getattr(client, call) if isinstance(call, str) else partial(call, client)
            target(*args, **kwargs)
    service.close(*clients)


def advantage_signs(client, advantages, mask):
    """``record_advantage_signs`` where AReaL records it: under ``ppo_actor``."""
    with client.scope("ppo_actor"):
        record_advantage_signs(client, advantages, mask)


def stats(x):
    x = x.double()
    return x.mean().item(), x.min().item(), x.max().item()


def assert_close(got, expected):
    assert set(expected) <= set(got), sorted(set(expected) - set(got))
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_data_metrics_equal_one_process_on_the_whole_batch():
    service = LocalService()
    # rank 3 has only wrong responses: it must not drag correct_length down with a 0
    batches = [make_batch(s, rows, all_wrong=(s == 3)) for s, rows in enumerate((2, 9, 5, 14))]
    for b in batches[:3]:
        b["token_level_scores"][0, 0] = 0.9  # some correct responses on the other ranks
        b["token_level_rewards"][0, 0] = 0.9
    run_ranks(service, [[("compute_local_data_metric", (b, WORLD), {})] for b in batches])
    got = service.final()["metrics"]

    whole = concat(batches)
    resp = whole["response_mask"].bool()
    seq_reward = whole["token_level_rewards"].double().sum(-1)
    length = resp.sum(-1).double()
    prompt_len = whole["attention_mask"][:, :P].sum(-1).double()
    ret, val = whole["returns"].double()[resp], whole["values"].double()[resp]
    expected = {"critic/vf_explained_var": 1 - torch.var(ret - val).item()
                / (torch.var(ret).item() + 1e-5),
                "response/clip_ratio/mean": (length == R).double().mean().item(),
                "prompt/clip_ratio/mean": (prompt_len == P).double().mean().item()}
    for name, x in {
        "critic/score": whole["token_level_scores"].double().sum(-1),
        "critic/rewards": seq_reward,
        "critic/advantages": whole["advantages"][resp],
        "critic/returns": whole["returns"][resp],
        "critic/values": whole["values"][resp],
        "response/length": length,
        "response/correct_length": length[seq_reward > 0.5],
        "response/wrong_length": length[seq_reward <= 0.5],
        "prompt/length": prompt_len,
        "num_turns": whole["num_turns"],
    }.items():
        expected.update(zip((f"{name}/mean", f"{name}/min", f"{name}/max"), stats(x)))
    assert_close(got, expected)
    assert got["perf/process_cpu_mem_used_gb"] >= got["perf/process_cpu_mem_used_gb/mean"] > 0

    # the siiRL defects this fixes, each visible on this data:
    per_rank_adv = [b["advantages"][b["response_mask"].bool()].double().mean() for b in batches]
    assert got["critic/advantages/mean"] != pytest.approx(np.mean(per_rank_adv), rel=1e-3)
    assert got["response/correct_length/min"] > 0  # no 0 placeholder from rank 3
    per_rank_ev = []
    for b in batches:
        m = b["response_mask"].bool()
        r, v = b["returns"].double()[m], b["values"].double()[m]
        per_rank_ev.append(1 - torch.var(r - v).item() / (torch.var(r).item() + 1e-5))
    assert got["critic/vf_explained_var"] != pytest.approx(np.mean(per_rank_ev), rel=1e-3)


def test_population_empty_everywhere_is_omitted():
    service = LocalService()
    batches = [make_batch(10 + s, 3, all_wrong=True) for s in range(2)]
    run_ranks(service, [[("compute_local_data_metric", (b,), {})] for b in batches])
    got = service.final()["metrics"]
    assert not any(k.startswith("response/correct_length") for k in got)
    assert "response/wrong_length/mean" in got


def test_timing_throughput_and_train_perf_are_exact_across_ranks():
    service = LocalService()
    batches = [make_batch(20 + s, rows) for s, rows in enumerate((3, 8, 1, 6))]
    timings = [{"gen": 1.0 + r, "update_actor": 0.5 * (r + 1), "step": 4.0 + r, "other": 0.1 * r}
               for r in range(WORLD)]
    model = SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, head_dim=16,
                            active_parameters=1_000_000)
    flops = [estimate_flops("dense_transformer", model, b["attention_mask"].sum(-1))
             for b in batches]  # each rank's packed sequences, each estimated on its own
    steps = 3
    for step in range(steps):
        run_ranks(service, [[
            ("compute_local_timing_metrics", (b, t, WORLD), {}),
            ("compute_local_throughput_metrics", (b, t, 8, WORLD), {}),
            (record_train_perf, (int(b["attention_mask"].sum()) * (step + 1), t["step"]),
             {"flops": f * (step + 1)}),
        ] for b, t, f in zip(batches, timings, flops)])
    got = service.final(steps - 1)["metrics"]

    resp_tokens = sum(b["response_mask"].sum().item() for b in batches)
    all_tokens = sum(b["attention_mask"].sum().item() for b in batches)
    expected = {
        "timing_s/gen": 4.0, "timing_s/update_actor": 2.0, "timing_s/step": 7.0,
        "timing_s/other": 0.3,
        "timing_per_token_ms/gen": 1000 * sum(t["gen"] for t in timings) / resp_tokens,
        "timing_per_token_ms/update_actor":
            1000 * sum(t["update_actor"] for t in timings) / all_tokens,
        "perf/total_num_tokens": all_tokens,
        "perf/time_per_step": 7.0,
        "perf/throughput": all_tokens / (7.0 * 8 * WORLD),  # per GPU: 8 on each rank
        "train_perf/tokens": all_tokens * steps,
        "train_perf/seconds": 7.0,
        "train_perf/tokens_per_second": all_tokens * steps / 7.0,
        "train_perf/total_tokens": all_tokens * (1 + 2 + 3),
        "train_perf/total_seconds": 7.0 * steps,
        "train_perf/cumulative_tokens_per_second": all_tokens * 6 / (7.0 * steps),
        "train_perf/estimated_flops": sum(flops) * steps,
        "train_perf/estimated_flops_per_second": sum(flops) * steps / 7.0,
        "train_perf/cumulative_estimated_flops_per_second": sum(flops) * 6 / (7.0 * steps),
    }
    assert_close(got, expected)
    assert "timing_per_token_ms/other" not in got and "timing_per_token_ms/step" not in got
    # What each exported name means, from its family's declaration: with the first step
    # that exports it, once
    from metricsvc.client.metrics import timing

    metas = [service.final(s)["meta"] for s in range(steps)]
    shown = metas[0]["descriptions"]
    assert set(shown) == set(expected), set(expected) ^ set(shown)
    assert shown["perf/throughput"] == {"help": timing.THROUGHPUT.help, "unit": "tokens/s/GPU"}
    assert shown["timing_s/gen"] == {"help": "seconds of a stage on the slowest rank",
                                     "unit": "s"}
    assert shown["train_perf/total_tokens"]["unit"] == "tokens"
    assert not any("descriptions" in m or "about" in m for m in metas[1:])


def validation_data(seed):
    rng = np.random.default_rng(seed)
    sources, inputs, acc, reward, preds = [], [], [], [], []
    for p in range(9):
        source = "gsm8k" if p % 3 else "math"
        n = 4 if p < 6 else 3
        for _ in range(n):
            sources.append(source)
            inputs.append(f"prompt-{p}")
            pred = str(rng.integers(0, 3))
            preds.append(pred)
            acc.append(float(pred == "1"))
            reward.append(float(rng.normal()))
    return sources, inputs, {"acc": acc, "reward": reward, "pred": preds}


def split_by_prompt(sources, inputs, infos, assignment):
    """Give every prompt group to one rank: ``assignment[prompt index] -> rank``."""
    parts = [([], [], {k: [] for k in infos}) for _ in range(WORLD)]
    for i, prompt in enumerate(inputs):
        rank = assignment[int(prompt.split("-")[1])]
        parts[rank][0].append(sources[i])
        parts[rank][1].append(prompt)
        for k in infos:
            parts[rank][2][k].append(infos[k][i])
    return parts


@pytest.mark.parametrize("assignment", [[0, 1, 2, 3, 0, 1, 2, 3, 0], [3, 3, 3, 3, 0, 1, 2, 1, 1]])
def test_validation_merges_by_prompt_group_and_ignores_the_split(assignment):
    service = LocalService()
    sources, inputs, infos = validation_data(7)
    parts = split_by_prompt(sources, inputs, infos, assignment)
    run_ranks(service, [[("process_local_validation_metrics",
                          (s, i, inf, [1, 3] * (len(s) // 2), WORLD), {})]
                        for s, i, inf in parts])
    got = service.final()["metrics"]
    whole = validation_metrics(sources, inputs, infos)
    expected = {k: float(np.mean(v)) for k, v in whole.items()}
    assert_close(got, expected)
    assert "val-core/gsm8k/acc/mean@4" in got and "val-core/gsm8k/acc/maj@4/mean" in got
    assert "val-aux/gsm8k/reward/best@2/std" in got
    assert (got["val-aux/num_turns/min"], got["val-aux/num_turns/max"]) == (1.0, 3.0)
    for source in ("gsm8k", "math"):
        picked = [r for r, s in zip(infos["reward"], sources) if s == source]
        assert got[f"val/test_score/{source}"] == pytest.approx(np.mean(picked), rel=1e-12)


def test_validation_mean_and_std_at_n_match_a_hand_computation():
    out = validation_metrics(["s"] * 4, ["p"] * 4, {"acc": [1.0, 0.0, 1.0, 1.0]})
    assert out["val-core/s/acc/mean@4"] == [0.75]
    assert out["val-aux/s/acc/std@4"] == [pytest.approx(np.std([1, 0, 1, 1]))]
    assert 0.75 < out["val-aux/s/acc/best@2/mean"][0] <= 1.0  # best of 2 beats the mean
    assert out["val-aux/s/acc/best@2/mean"][0] < out["val-core/s/acc/best@4/mean"][0]
    assert set(k.split("/")[-2] for k in out if "@" in k.split("/")[-2]) == {"best@2", "worst@2",
                                                                            "best@4", "worst@4"}


def _areal_train_infer(t, r, mask):
    """AReaL's log_train_inference_stats in one process, on the concatenated tokens (what
    metricsvc exports by default: a NaN/inf value of a mean is left out and counted)."""
    finite = torch.isfinite(t) & torch.isfinite(r)
    d = t - r
    k3 = torch.expm1(d) - d

    def mean(x):  # over masked tokens, NaN/inf values left out (output.nonfinite: exclude)
        x = x[mask]
        return x[torch.isfinite(x)].mean().item()

    out = {"n_valid_tokens": float(mask.sum()), "logp_diff_squared": mean(d * d),
           "trainer_nll": mean(-t), "rollout_nll": mean(-r), "kl_k1": mean(-d),
           "kl_k2": mean(d * d / 2), "kl_k3": mean(k3),
           "kl_k3_overflow_fraction": (~torch.isfinite(k3) & finite)[mask].double().mean().item(),
           "nonfinite_logp_fraction": (~finite)[mask].double().mean().item()}
    for th in (1.5, 2, 3, 5, 10):  # NaN where a masked token is not finite, as AReaL's
        tail = torch.where(finite, (d.abs() > math.log(th)).double(), math.nan)[mask]
        out[f"ratio_outside_{th:g}"] = tail.mean().item()
    use = mask & finite & torch.isfinite(d)
    out.update(zip(("logp_diff/mean", "logp_diff/min", "logp_diff/max"), stats(d[use])))
    out.update(zip(("logp_abs_diff/mean", "logp_abs_diff/min", "logp_abs_diff/max"),
                   stats(d[use].abs())))
    return out


def test_logp_diagnostics_are_arealss_definitions_exact_across_unequal_ranks():
    """Step 0: a masked -inf log-prob on one rank makes every ratio tail NaN (AReaL: "never
    silently classifying invalid comparisons as zero"), a gap past float64's expm1 counts
    in kl_k3_overflow_fraction, AReaL's large finite gap (d = 100) keeps k3 finite; step 1:
    every log-prob finite, the tails are the one-process shares."""
    service = LocalService()
    g = torch.Generator().manual_seed(3)
    steps = []
    for step in range(2):
        parts = []
        for rank, rows in enumerate((2, 7, 4, 11)):
            t = -torch.rand(rows, 6, generator=g) * 3
            r = t + torch.randn(rows, 6, generator=g) * 0.8
            mask = torch.rand(rows, 6, generator=g) < 0.8
            if step == 0 and rank == 1:
                r[0, 0], t[0, 1], r[0, 1], t[1, 0], r[1, 0] = (
                    float("-inf"), -1.0, -101.0, -1.0, -801.0)
                mask[:2, :2] = True
            parts.append((t, r, mask))
        steps.append(parts)
        run_ranks(service, [[(record_logp_diagnostics, p, {})] for p in parts])
    for step, parts in enumerate(steps):
        got = service.final(step)["metrics"]
        t, r, mask = (torch.cat([p[i] for p in parts]).double() for i in range(3))
        expected = _areal_train_infer(t, r, mask.bool())
        for th in (1.5, 2, 3, 5, 10):
            key = f"ratio_outside_{th:g}"
            if step == 0:
                assert math.isnan(got[key]) and math.isnan(expected.pop(key)), key
        assert_close(got, expected)
    first = service.final(0)
    assert first["metrics"]["kl_k3_overflow_fraction"] > 0
    assert first["meta"]["nonfinite"]["kl_k3"] == 2  # the -inf token's and the overflow's
    assert first["metrics"]["nonfinite_logp_fraction"] > 0


def test_advantage_sign_fractions_are_token_occupancy_over_every_rank():
    """AReaL's ppo_actor/advantage_{positive,negative,zero}_fraction: the share of loss-masked
    tokens by the sign of the shaped advantage, over the concatenated tokens (unequal
    ranks, exact zeros, a NaN advantage in none of the three)."""
    service = LocalService()
    g = torch.Generator().manual_seed(5)
    parts = []
    for rows in (1, 6, 3):
        adv = torch.randn(rows, 7, generator=g)
        adv[adv.abs() < 0.4] = 0.0  # GRPO's all-equal groups: exact zeros
        adv[0, 0] = float("nan")
        parts.append((adv, torch.rand(rows, 7, generator=g) < 0.6))
    run_ranks(service, [[(advantage_signs, p, {})] for p in parts])
    got = service.final()["metrics"]
    adv = torch.cat([p[0][p[1]] for p in parts]).double()
    assert_close(got, {"ppo_actor/advantage_positive_fraction": (adv > 0).double().mean().item(),
                       "ppo_actor/advantage_negative_fraction": (adv < 0).double().mean().item(),
                       "ppo_actor/advantage_zero_fraction": (adv == 0).double().mean().item()})


def test_moe_balance_sums_counts_before_normalising():
    service = LocalService()
    per_rank = [
        {0: torch.tensor([10, 0, 5, 5]), 1: torch.tensor([0, 0, 0, 0])},
        {0: torch.tensor([0, 30, 0, 10]), 1: torch.tensor([0, 0, 0, 0])},
        {0: np.array([1, 1, 1, 1])},
    ]
    run_ranks(service, [[(record_moe_balance, (c,), {})] for c in per_rank])
    got = service.final()["metrics"]
    total = np.array([11, 31, 6, 16], dtype=float)
    for e, tokens in enumerate(total):
        assert got[f"moe_balance/layer_0/expert_{e}/tokens"] == tokens
        assert got[f"moe_balance/layer_0/expert_{e}/load_percent"] == pytest.approx(
            100 * tokens / total.sum(), rel=1e-12)
    assert got["moe_balance/layer_0/max_over_ideal"] == pytest.approx(31 / (64 / 4), rel=1e-12)
    assert got["moe_balance/layer_1/max_over_ideal"] == 0.0
    assert got["moe_balance/layer_1/expert_2/load_percent"] == 0.0
    # per-rank normalisation would average the ranks' load shares instead: different
    per_rank_share = np.mean([c[0][1] / max(float(np.sum(np.asarray(c[0]))), 1) * 100
                              for c in per_rank])
    assert got["moe_balance/layer_0/expert_1/load_percent"] != pytest.approx(per_rank_share)


def test_siirl_method_names_exist_with_the_correct_spelling_alias(ray_cluster):
    c = MetricClient(None, rank=0, world_size=2, name="unused")
    assert c.compute_local_throughput_metrics == c.compute_local_throughout_metrics
    with pytest.raises(ValueError, match=r"must be in \[1, 2\]"):
        c.compute_local_data_metric(make_batch(0, 2), world_size=3)


def test_siirl_methods_read_each_token_tensor_once_without_float64_copies():
    """Issue 19: on siiRL's batch the built-in methods cost about what siiRL's own functions
    do. Counted, not timed: torch calls that touch data, gathers, whole-tensor widenings."""
    from torch.overrides import TorchFunctionMode

    class Ops(TorchFunctionMode):
        META = {"__get__", "numel", "detach", "data_ptr", "stride", "is_floating_point",
                "reshape", "numpy", "item", "dim", "size", "__len__"}

        def __init__(self, attention):
            super().__init__()
            self.calls, self.widened, self.attention = [], 0, attention
            self.whole_mask_reads = 0  # passes over the whole attention mask
            self.token_views = 0  # numpy views of a whole [B, R] tensor (a gather reads one)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", str(func))
            if name == "numpy" and args[0].numel() == self.attention.shape[0] * 1024:
                self.token_views += 1
            if name not in self.META:
                self.calls.append(name)
                self.whole_mask_reads += (name != "__getitem__" and bool(args)
                                          and args[0] is self.attention)
            if (isinstance(out, torch.Tensor) and out.dtype == torch.float64
                    and out.numel() >= 64 * 1024 // 2):
                # A new float64 tensor as large as half a token tensor (views and in-place
                # fills of the client's kept scratch buffers share an input's storage).
                ptr = out.untyped_storage().data_ptr()
                self.widened += not any(
                    isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                    for a in (*args, *(kwargs or {}).values()))
            return out

    g = torch.Generator().manual_seed(0)
    b, p, r = 64, 512, 1024
    rlen = torch.randint(r // 8, r + 1, (b,), generator=g)
    plen = torch.randint(p // 4, p + 1, (b,), generator=g)
    rmask = torch.arange(r)[None, :] < rlen[:, None]
    pmask = torch.arange(p)[None, :] >= (p - plen)[:, None]
    batch = {"responses": torch.zeros(b, r, dtype=torch.long),
             "attention_mask": torch.cat([pmask, rmask], 1).long(),
             "token_level_scores": torch.rand(b, r, generator=g),
             "token_level_rewards": torch.rand(b, r, generator=g),
             **{k: torch.randn(b, r, generator=g) for k in ("advantages", "returns", "values")}}
    timing = {s: 0.5 for s in ("gen", "ref", "values", "adv", "update_actor", "step")}
    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    c.compute_local_data_metric(batch)  # the first step makes the scratch buffers it keeps
    c.buffer.discard()
    batch = {k: v.clone() for k, v in batch.items()}  # the next step's batch
    with Ops(batch["attention_mask"]) as ops:
        c.compute_local_data_metric(batch)
        c.compute_local_timing_metrics(batch, timing)
        c.compute_local_throughout_metrics(batch, timing, 1)
    # siiRL's functions make about 50 such calls on this batch (without verl's aborted
    # and non-aborted keys, which take 5 more here); main made 510.
    assert len(ops.calls) <= 75, sorted(ops.calls)
    # numpy gathers by the bool response mask (torch's gather would read an index 8 times
    # its size): a view of it and of advantages, returns, values, once each; no torch gather
    assert ops.token_views == 4 and "index_select" not in ops.calls
    assert ops.widened == 0 and "nonzero" not in ops.calls
    # The prompt and response parts are each read for their lengths; the throughput's
    # token count is their sum, not another pass over the whole mask.
    assert ops.whole_mask_reads == 0
    assert len(c.pending_keys()) >= 20


@pytest.mark.parametrize("own_response_mask", [False, True])
@pytest.mark.parametrize("data_first", [False, True])
def test_the_throughput_counts_the_attention_masks_tokens_whatever_was_recorded_first(
        own_response_mask, data_first):
    """With the data metrics recorded first in the step the token count comes from their
    prompt and response lengths (the mask's two parts); with a response mask of its own
    (multi-turn: tool output is no response token) or alone, from the mask itself."""
    batch = make_batch(3, 6)
    if not own_response_mask:
        del batch["response_mask"]
    tokens = float(batch["attention_mask"].sum())
    assert own_response_mask is (batch.get("response_mask") is not None)
    if own_response_mask:  # a response token the response mask leaves out
        batch["response_mask"][0, 0] = 0
    timing = {"gen": 1.0, "step": 2.0}
    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    if data_first:
        c.compute_local_data_metric(batch)
    c.compute_local_throughput_metrics(batch, timing, 1)
    sent = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    row = sent.data[sent.keys.index("perf/total_num_tokens")]
    assert row[SUM] == tokens and row[COUNT] == 1


def test_a_family_call_of_several_kinds_is_one_record_whose_keys_keep_their_kinds():
    """The throughput's three numbers (two SUM, one MAX) are one record of the buffer (one
    part); recorded again they merge at the close as each key's kind says, a key recorded
    on its own keeps its kind, and recording it with another kind is refused naming both."""
    from metricsvc.core.records import MAX as MAX_FIELD
    from metricsvc.core.reduce import ReduceType

    batch = make_batch(3, 6)
    tokens = float(batch["attention_mask"].sum())
    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    c.compute_local_throughput_metrics(batch, {"step": 2.0}, 1)
    assert len(c.buffer.parts) == 1
    c.compute_local_throughput_metrics(batch, {"step": 3.0}, 1)  # a micro-batch: kept
    assert len(c.buffer.parts) == 2
    c.stat(reduce="max", **{"perf/time_per_step": 2.5})  # out of the block, still MAX
    with pytest.raises(ValueError, match=r"'perf/time_per_step' was recorded as MAX.*as SUM"):
        c.stat(reduce="sum", **{"perf/time_per_step": 1.0})
    sent = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    got = {k: (int(code), row) for k, code, row in zip(sent.keys, sent.kinds, sent.data)}
    assert got["perf/total_num_tokens"][0] == ReduceType.SUM
    assert got["perf/total_num_tokens"][1][SUM] == 2 * tokens
    assert got["__perf/throughput/gpus"][0] == ReduceType.SUM
    assert got["__perf/throughput/gpus"][1][SUM] == 2.0
    assert got["perf/time_per_step"][0] == ReduceType.MAX
    assert got["perf/time_per_step"][1][MAX_FIELD] == 3.0
    assert got["perf/time_per_step"][1][COUNT] == 3


def test_every_built_in_family_records_exactly_what_it_declares():
    """The family declarations (name, kind, help) are the source of truth: every key a
    recorder records matches one declared Metric of its family, with that kind, and every
    derived metric it declares matches a declared Derived; every declaration is used."""
    from metricsvc.client import Derived, Metric
    from metricsvc.client.metrics import (
        FAMILIES,
        record_advantage_signs,
        record_logp_diagnostics,
        record_moe_balance,
        record_process_memory,
        record_rollout_probs_diff,
        record_throughput_metrics,
        record_timing_metrics,
        record_train_perf,
        record_validation_metrics,
        record_version_stats,
    )

    b = make_batch(0, 6)
    timing = {"gen": 1.0, "update_actor": 0.5, "step": 4.0, "other": 0.1}
    g = torch.Generator().manual_seed(0)
    recorders = {
        "data": lambda c: (c.compute_local_data_metric(
            {**b, "tool_call_counts": torch.arange(6)}), record_process_memory(c)),
        "timing": lambda c: (record_timing_metrics(c, b, timing),
                             record_throughput_metrics(c, b, timing, 2),
                             record_train_perf(c, torch.tensor(100.0), 2.0, flops=3e9)),
        "validation": lambda c: record_validation_metrics(
            c, ["gsm8k"] * 4, ["p1", "p1", "p2", "p2"],
            {"reward": [1.0, 0.0, 1.0, 1.0], "acc": [1.0, 0.0, 1.0, 1.0]}, [1, 2, 1, 3]),
        "diagnostics": lambda c: (record_logp_diagnostics(
            c, torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g),
            torch.rand(3, 5, generator=g) > 0.3), record_rollout_probs_diff(
            c, {"rollout_log_probs": -torch.rand(3, 5, generator=g),
                "old_log_probs": -torch.rand(3, 5, generator=g)}), record_advantage_signs(
            c, torch.randn(3, 5, generator=g), torch.rand(3, 5, generator=g) > 0.3),
            record_version_stats(c, torch.tensor([[-1, 3, 4, 6]]), torch.ones(1, 4), 5)),
        "moe": lambda c: record_moe_balance(c, {0: torch.tensor([3, 1, 0]), 1: [2, 2, 2]}),
    }
    for family, record in recorders.items():
        declared = FAMILIES[family]
        c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
        record(c)
        used = set()
        names = c.buffer.declarations.held
        sent = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
        for key, code in zip(sent.keys, sent.kinds):  # each key's kind as the wire has it
            found = [d for d in declared if isinstance(d, Metric) and d.matches(key)]
            assert len(found) == 1, (family, key, found)
            assert int(found[0].kind) == code, (family, key)
            used.add(found[0].name)
        for name in names:
            found = [d for d in declared if isinstance(d, Derived) and d.matches(name)]
            assert len(found) == 1, (family, name)
            used.add(found[0].name)
        unused = [d.name for d in declared if d.name not in used]
        assert not unused, (family, unused)
        assert all(d.help for d in declared), family


def test_moe_balance_declares_two_metrics_whatever_the_number_of_layers_and_experts():
    from metricsvc.client.metrics import record_moe_balance

    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    record_moe_balance(c, {layer: torch.arange(16) for layer in range(8)})
    first = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    assert len(first.keys) == 8 * 16 and len(c.buffer.declarations.held) == 2
    assert b'"about"' in first.derived  # what the two mean: with the first batch only
    record_moe_balance(c, {layer: torch.arange(16) for layer in range(8)})
    batch = c.buffer.take_batch(step=1, rank=0, world_size=1, seq=1, final=True)
    assert len(batch.derived) < 600  # bytes per batch for 128 load_percent and 8 layers


def test_a_batch_of_numpy_arrays_gets_one_line_saying_what_the_recorders_read():
    import numpy as np

    from metricsvc.client import MetricClient

    c = MetricClient(None, rank=0, world_size=1)
    batch = {"responses": np.zeros((2, 4)), "attention_mask": np.ones((2, 8), np.int64)}
    with pytest.raises(TypeError) as err:
        c.compute_local_data_metric(batch)
    message = str(err.value)
    assert "batch['attention_mask'] is a numpy.ndarray" in message and "\n" not in message
    assert "pip install 'metricsvc[torch]'" in message and "stat()" in message
    assert c.pending_keys() == []


def test_a_family_catalogue_gives_each_key_its_one_declared_kind():
    """The declarations drive the recording: a recorder asks its family's catalogue for a
    key's kind (declared once, with its help text); an undeclared key is refused."""
    from metricsvc.client.metrics import data, timing
    from metricsvc.client.metrics.catalogue import Catalogue
    from metricsvc.core.reduce import ReduceType

    assert isinstance(data.METRICS, Catalogue)
    assert data.METRICS.kind("critic/score") is ReduceType.AVG_MIN_MAX
    assert timing.METRICS.kind("timing_s/gen") is ReduceType.MAX  # a family's key
    assert timing.METRICS.kind("perf/total_num_tokens") is ReduceType.SUM
    with pytest.raises(KeyError, match="'critic/unknown' is declared 0 times"):
        data.METRICS.kind("critic/unknown")


def test_each_name_is_described_once_whatever_arrives_later_and_after_a_restart():
    """A name's description goes to the sinks with the first step that exports it, once:
    descriptions that arrive later (another family recorded from a later step on) or are
    read back after a restart never send it again."""
    from metricsvc.service.output import Descriptions

    live = Descriptions()
    assert live.learn({"timing_s/<stage>": ("seconds", "s")}, 0)
    first = live.of(["timing_s/gen", "x"], 0)
    assert first == {"timing_s/gen": {"help": "seconds", "unit": "s"}}
    assert live.learn({"x": ("an x", "")}, 1)  # a later family: x is described now
    assert live.of(["timing_s/gen", "x"], 1) == {"x": {"help": "an x", "unit": ""}}
    assert live.of(["timing_s/gen", "x"], 2) == {}

    restarted = Descriptions()  # the journal's steps, read back in order
    restarted.restore({"about": {"timing_s/<stage>": ["seconds", "s"]},
                       "descriptions": first}, 0)
    restarted.restore({"about": {"x": ["an x", ""]}}, 1)
    assert restarted.of(["timing_s/gen", "x"], 2) == {"x": {"help": "an x", "unit": ""}}

    live.forget_after(0)  # a rewind to step 0: step 1's description is given again
    assert live.learn({}, 1) == {"x": ["an x", ""]}
    assert live.of(["timing_s/gen", "x"], 1) == {"x": {"help": "an x", "unit": ""}}


def test_data_metrics_on_the_host_and_on_an_accelerator_record_the_same_rows():
    """The per-sequence values take numpy on the host and stay torch tensors on a device
    (here the accelerator path on the CPU): the two record the same keys and rows, with
    aborted, clipped, correct and wrong responses all present."""
    from metricsvc.client.tensors import accelerator_path_on_cpu

    batch = make_batch(7, 12)
    for row, valid in ((0, 0), (1, 1)):  # an aborted response, one at the maximum length
        batch["attention_mask"][row, P:] = valid
        batch["response_mask"][row] = valid
    batch["token_level_rewards"][2:5, 0] = 0.9  # some correct ones
    batches = []
    for device_path in (False, True):
        c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
        if device_path:
            with accelerator_path_on_cpu():
                c.compute_local_data_metric(batch)
        else:
            c.compute_local_data_metric(batch)
        batches.append(c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True))
    host, device = batches
    assert host.keys == device.keys and "response/length_non_aborted" in host.keys
    rows = dict(zip(device.keys, device.data))
    aborted = rows["response/aborted_ratio"]
    assert aborted[SUM] == 1 and aborted[COUNT] == 12
    assert rows["response/clip_ratio/mean"][SUM] >= 1
    assert rows["response/correct_length"][COUNT] >= 3
    for key, row in zip(host.keys, host.data):
        if key.startswith("perf/process_cpu_mem"):
            continue  # the process grew in between
        np.testing.assert_allclose(row, rows[key], rtol=1e-13, atol=1e-300, err_msg=key)


@pytest.mark.parametrize("response_mask", [True, False])
def test_siirl_methods_on_an_accelerator_read_nothing_back_until_the_flush(response_mask):
    """siiRL's data, timing and throughput methods on a device batch (here the accelerator
    path on the CPU) record without one host read, whether the batch has its own response
    mask or takes it from the attention mask: the flush's one copy is the only one."""
    from metricsvc.client.tensors import accelerator_path_on_cpu
    from tests.synccount import HostTransferCounter

    batch = make_batch(3, 9)
    if not response_mask:
        del batch["response_mask"]
    timing = {"gen": 0.5, "update_actor": 0.25, "step": 1.0}
    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    with accelerator_path_on_cpu(), HostTransferCounter() as counter:
        c.compute_local_data_metric(batch)
        c.compute_local_timing_metrics(batch, timing)
        c.compute_local_throughput_metrics(batch, timing, n_gpus=1)
        recorded = list(counter.calls)
        c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    assert recorded == [] and counter.count == 1, counter.calls


def test_flops_estimators_are_registered_per_model_built_once_and_sum_packed_sequences():
    """AReaL's register_flops_estimator: a factory per model type, called once per model
    and config; a packed batch is the sum of each sequence's estimate, never the estimate
    of the summed length; an unknown model type is a one-line error naming the registered
    ones. The reference dense estimator is the page's 6 P L + 6 layers heads head_dim L (L+1)."""
    from metricsvc.client.metrics import (
        flops_estimator,
        register_flops_estimator,
    )

    calls = []

    def factory(config):
        calls.append(config)
        return lambda length: float(config.k * length * length)

    register_flops_estimator("toy_quadratic", factory)
    config = SimpleNamespace(k=3)
    assert estimate_flops("toy_quadratic", config, [3, 5]) == 3 * 9 + 3 * 25  # not 3 * 64
    assert estimate_flops("toy_quadratic", config, torch.tensor([2, 2])) == 24
    assert flops_estimator("toy_quadratic", config) is flops_estimator("toy_quadratic", config)
    assert calls == [config]  # built once for the model and its config
    with pytest.raises(ValueError) as err:
        estimate_flops("no_such_model", config, [1])
    message = str(err.value)
    assert "'no_such_model'" in message and "toy_quadratic" in message and "\n" not in message
    dense = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                            num_parameters=1000)
    assert estimate_flops("dense_transformer", dense, [10]) == (
        6 * 1000 * 10 + 6 * 2 * 4 * 16 * 10 * 11)


def test_a_fresh_config_each_step_keeps_a_bounded_number_of_estimators_alive():
    """Code that builds its model config anew each step (a dict, a namespace) gets the same
    numbers, and the estimators kept for configs are bounded: each held its config alive,
    so a long run kept every step's config and estimator."""
    import gc
    import weakref

    from metricsvc.client.metrics import register_flops_estimator

    class Config:  # a model config (SimpleNamespace takes no weak reference)
        k = 2

    register_flops_estimator("toy_linear", lambda config: lambda n: float(config.k * n))
    alive = []
    for step in range(2000):
        config = Config()
        alive.append(weakref.ref(config))
        assert estimate_flops("toy_linear", config, [step]) == 2.0 * step
    del config
    gc.collect()
    assert sum(ref() is not None for ref in alive) <= 64


def test_device_timing_on_the_cpu_is_wall_time_read_at_the_flush_with_no_wait():
    """``record_timing(..., device=True)`` and ``timed_train_perf`` on the CPU: the wall time
    of each block (AReaL's CPU timing), kept unread until the close, no device wait; a
    block timed twice in a step is two records of its key."""
    import time

    from metricsvc.client.metrics import timed_train_perf

    c = MetricClient(None, rank=0, world_size=1)  # never sends: no actor needed
    spans = []
    for pause in (0.03, 0.01):
        before = time.perf_counter()
        with c.record_timing("update", device=True):
            time.sleep(pause)
        spans.append((pause, time.perf_counter() - before))
    before = time.perf_counter()
    with timed_train_perf(c, torch.tensor(100.0)):
        time.sleep(0.02)
    spans.append((0.02, time.perf_counter() - before))
    assert c.buffer.keys() == ["train_perf/tokens", "timing_s/update", "train_perf/seconds"]
    assert "timing_s/update" not in c.buffer.kinds  # unread until the close
    sent = c.buffer.take_batch(step=0, rank=0, world_size=1, seq=0, final=True)
    row = dict(zip(sent.keys, sent.data))
    update = row["timing_s/update"]
    assert update[COUNT] == 2
    assert spans[0][0] + spans[1][0] <= update[SUM] <= spans[0][1] + spans[1][1]
    assert spans[2][0] <= row["train_perf/seconds"][SUM] <= spans[2][1]
    assert row["train_perf/tokens"][SUM] == 100.0
    assert c.buffer.device_waits == 0 and not c.buffer.timings
