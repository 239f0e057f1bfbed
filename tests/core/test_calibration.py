"""The robust calibration factor: one vote per node, MAD rejection, clamps, the upper bound."""

from __future__ import annotations

import math
from dataclasses import replace
from statistics import NormalDist

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.calibration import (
    CALIBRATOR_MEMO_ENTRIES,
    EMPTY_TABLE,
    FACTOR_MAX,
    FACTOR_MIN,
    MAD_TO_SIGMA,
    MIN_LOG_SPREAD,
    MIN_MODELS,
    MIN_NODES,
    OUTLIER_Z,
    SHIFT_Z,
    UPPER_EXCEEDANCE,
    UPPER_MULTIPLIER_CEILING,
    UPPER_MULTIPLIER_MAX,
    UPPER_MULTIPLIER_MIN,
    AppliedFactor,
    FactorTable,
    GroupKey,
    ImplausibleMeasurementError,
    Level,
    Measured,
    Observation,
    Outcome,
    Sample,
    Scope,
    calibrate,
    check_measured,
    fit_factor,
    fit_global_factor,
    fit_table,
    flag_outlier,
    upper_prediction_log_margin,
)
from service.core.result import Estimate, ParamCounts, Phase
from service.core.student_t import student_t_quantile
from service.core.units import GIB

GPU_TOTAL = 80 * GIB

absurd_ratio = st.one_of(
    st.floats(min_value=1e-9, max_value=0.05),
    st.floats(min_value=20.0, max_value=1e9),
    st.floats(min_value=1e-9, max_value=1e9),
)


@st.composite
def honest_nodes(draw: st.DrawFn, low: float = 0.85, high: float = 1.3) -> list[Sample]:
    """Nodes that agree within a few percent, each with a handful of completed runs."""
    center = draw(st.floats(min_value=low, max_value=high))
    count = draw(st.integers(min_value=MIN_NODES, max_value=12))
    samples: list[Sample] = []
    for index in range(count):
        for noise in draw(st.lists(st.floats(0.95, 1.05), min_size=1, max_size=6)):
            samples.append(Sample(voter=f"node-{index}", ratio=center * noise))
    return samples


def votes(samples: list[Sample]) -> dict[str, float]:
    """Each node's median completed ratio (geometric mean of the middle two when even)."""
    by_node: dict[str, list[float]] = {}
    for sample in samples:
        if sample.outcome is Outcome.COMPLETED:
            by_node.setdefault(sample.voter, []).append(math.log(sample.ratio))
    medians = {}
    for node, logs in by_node.items():
        logs.sort()
        mid = len(logs) // 2
        medians[node] = math.exp(logs[mid] if len(logs) % 2 else (logs[mid - 1] + logs[mid]) / 2)
    return medians


class TestCheckMeasured:
    def test_accepts_a_possible_measurement(self) -> None:
        check_measured(
            Measured(allocated_bytes=10 * GIB, reserved_bytes=12 * GIB, device_bytes=13 * GIB),
            gpu_memory_total_bytes=GPU_TOTAL,
        )

    @pytest.mark.parametrize(
        ("measured", "field", "words"),
        [
            (Measured(), "measured", "at least one level"),
            (Measured(device_bytes=0), "measured.device_bytes", "positive"),
            (Measured(reserved_bytes=-5), "measured.reserved_bytes", "positive"),
            (Measured(device_bytes=GPU_TOTAL + 1), "measured.device_bytes", "above the GPU"),
            (
                Measured(allocated_bytes=9 * GIB, reserved_bytes=8 * GIB),
                "measured.allocated_bytes",
                "cannot exceed reserved",
            ),
        ],
    )
    def test_rejects_values_that_cannot_be_true(
        self, measured: Measured, field: str, words: str
    ) -> None:
        with pytest.raises(ImplausibleMeasurementError) as caught:
            check_measured(measured, gpu_memory_total_bytes=GPU_TOTAL)
        assert caught.value.field == field
        assert words in caught.value.reason
        assert isinstance(caught.value, ValueError)

    def test_a_peak_equal_to_the_gpu_total_is_possible(self) -> None:
        check_measured(Measured(device_bytes=GPU_TOTAL), gpu_memory_total_bytes=GPU_TOTAL)


class TestFitFactor:
    def test_needs_min_nodes_distinct_nodes(self) -> None:
        runs = [Sample(voter=f"n{i % (MIN_NODES - 1)}", ratio=1.1) for i in range(50)]
        assert fit_factor(runs) is None
        assert fit_factor([*runs, Sample(voter="another", ratio=1.1)]) is not None

    def test_is_the_median_of_node_votes(self) -> None:
        # Node b's runs (mean 1.10) vote with their median, 1.04, as a and c do: the votes
        # agree exactly, so the median stands unshifted.
        samples = [
            Sample(voter="a", ratio=1.04),
            Sample(voter="b", ratio=0.96),
            Sample(voter="b", ratio=1.04),
            Sample(voter="b", ratio=1.30),
            Sample(voter="c", ratio=1.04),
        ]
        factor = fit_factor(samples)
        assert factor is not None
        assert factor.ratio == pytest.approx(1.04)
        assert factor.log_spread == 0.0
        assert factor.nodes == 3
        assert factor.runs == 5
        assert factor.rejected_nodes == ()

    def test_rejects_a_node_far_from_the_others(self) -> None:
        samples = [Sample(voter=f"n{i}", ratio=1.0 + 0.01 * i) for i in range(5)]
        samples.append(Sample(voter="broken", ratio=1.45))
        factor = fit_factor(samples)
        without = fit_factor(samples[:-1])
        assert factor is not None and without is not None
        assert factor.rejected_nodes == ("broken",)
        assert factor.nodes == 5
        # The broken node moves nothing: the factor is the five others' alone.
        assert replace(factor, rejected_nodes=()) == without

    def test_too_few_nodes_left_after_rejection_gives_none(self) -> None:
        samples = [
            Sample(voter="a", ratio=1.0),
            Sample(voter="b", ratio=1.0),
            Sample(voter="c", ratio=9.0),
        ]
        assert fit_factor(samples) is None

    def test_clamps_the_median(self) -> None:
        low = fit_factor([Sample(voter=f"n{i}", ratio=0.3) for i in range(4)])
        high = fit_factor([Sample(voter=f"n{i}", ratio=4.0) for i in range(4)])
        assert low is not None and high is not None
        assert (low.ratio, low.clamped) == (FACTOR_MIN, True)
        assert (high.ratio, high.clamped) == (FACTOR_MAX, True)

    def test_upper_bound_covers_every_run_that_supports_it(self) -> None:
        # 40 runs, each within the votes' reach: none may lie above the bound, so it sits on
        # the largest (a 95 % quantile would sit on the third, 1.37). (Eight voters: with
        # four, the prediction bound of the few votes, 1.373, is the wider one.)
        ratios = [1.0 + i / 100 for i in range(40)]
        samples = [Sample(voter=f"n{i % 8}", ratio=r) for i, r in enumerate(ratios)]
        factor = fit_factor(samples)
        assert factor is not None
        assert factor.upper_ratio == pytest.approx(1.39)
        assert sum(r > factor.upper_ratio for r in ratios) == 0

    def test_a_run_far_above_the_votes_supports_nothing(self) -> None:
        # One voter's run at 1.6 lies 3.5 spreads above the votes (1.0, spread floored at
        # 5 %): it no more lifts the bound than a vote that far would count.
        samples = [Sample(voter=f"n{i}", ratio=1.0) for i in range(5)]
        far = fit_factor([*samples, Sample(voter="n0", ratio=1.6), Sample(voter="n0", ratio=1.0)])
        near = fit_factor([*samples, Sample(voter="n0", ratio=1.15), Sample(voter="n0", ratio=1.0)])
        alone = fit_factor(samples)
        assert far is not None and near is not None and alone is not None
        assert far.upper_ratio == alone.upper_ratio < 1.15
        assert near.upper_ratio == pytest.approx(1.15)

    def test_oom_runs_raise_the_upper_bound_but_not_the_median(self) -> None:
        completed = [Sample(voter=f"n{i}", ratio=1.0 + i / 100) for i in range(5)]
        base = fit_factor(completed)
        oom = [Sample(voter="n0", ratio=1.3, outcome=Outcome.OOM)]
        low_oom = [Sample(voter="n1", ratio=0.5, outcome=Outcome.OOM)]
        with_oom = fit_factor(completed + oom + low_oom)
        assert base is not None and with_oom is not None
        assert with_oom.ratio == base.ratio
        assert with_oom.upper_ratio == pytest.approx(1.3)
        assert with_oom.oom_runs == 1

    def test_oom_only_nodes_cast_no_vote(self) -> None:
        samples = [Sample(voter=f"n{i}", ratio=0.5, outcome=Outcome.OOM) for i in range(10)]
        assert fit_factor(samples) is None

    @given(
        # Honest nodes may agree on a ratio beyond the clamps (an estimator far off).
        honest=honest_nodes(low=0.4, high=3.0),
        attack=st.lists(absurd_ratio, min_size=1, max_size=25),
    )
    @settings(max_examples=60, deadline=None)
    def test_a_node_with_a_thousand_absurd_values_moves_no_factor_beyond_its_clamp(
        self, honest: list[Sample], attack: list[float]
    ) -> None:
        flood = [
            Sample(
                voter="attacker",
                ratio=attack[i % len(attack)],
                outcome=Outcome.OOM if i % 3 == 0 else Outcome.COMPLETED,
            )
            for i in range(1000)
        ]
        factor = fit_factor(honest + flood)
        assert factor is not None
        assert FACTOR_MIN <= factor.ratio <= FACTOR_MAX
        assert factor.upper_multiplier >= UPPER_MULTIPLIER_MIN
        # One vote among honest ones moves the median by at most one rank: it stays
        # between the honest votes (each clamped), and the shift only moves it toward 1.
        raw_votes = votes(honest).values()
        honest_votes = [min(max(v, FACTOR_MIN), FACTOR_MAX) for v in raw_votes]
        assert min(*honest_votes, 1.0) - 1e-9 <= factor.ratio <= max(*honest_votes, 1.0) + 1e-9
        # The bound rises past the clamps' ceiling only to runs within the reach of the votes'
        # median, which lies among the honest votes: the absurd runs lift it no further.
        reach = math.exp(OUTLIER_Z * max(factor.log_spread, MIN_LOG_SPREAD))
        ceiling = max(UPPER_MULTIPLIER_CEILING, max(raw_votes) * reach)
        assert factor.upper_ratio <= ceiling * (1 + 1e-12)

    @given(samples=honest_nodes(), copies=st.integers(min_value=2, max_value=50))
    @settings(max_examples=60, deadline=None)
    def test_one_vote_per_node(self, samples: list[Sample], copies: int) -> None:
        loud = samples[0].voter
        repeated = samples + [s for s in samples if s.voter == loud] * copies
        single, many = fit_factor(samples), fit_factor(repeated)
        assert single is not None and many is not None
        assert many.ratio == single.ratio
        assert many.nodes == single.nodes
        assert many.rejected_nodes == single.rejected_nodes

    @given(samples=honest_nodes())
    @settings(max_examples=100, deadline=None)
    def test_at_most_five_percent_of_completed_runs_exceed_the_upper_bound(
        self, samples: list[Sample]
    ) -> None:
        factor = fit_factor(samples)
        assert factor is not None
        counted = [s.ratio for s in samples if s.voter not in factor.rejected_nodes]
        above = sum(r > factor.upper_ratio * (1 + 1e-12) for r in counted)
        assert above <= math.floor(UPPER_EXCEEDANCE * len(counted))

    @given(samples=honest_nodes(), oom=st.lists(st.floats(0.1, 3.0), max_size=30))
    @settings(max_examples=100, deadline=None)
    def test_oom_runs_never_lower_the_factor_or_the_upper_bound(
        self, samples: list[Sample], oom: list[float]
    ) -> None:
        base = fit_factor(samples)
        nodes = sorted({s.voter for s in samples})
        lower_bounds = [
            Sample(voter=nodes[i % len(nodes)], ratio=r, outcome=Outcome.OOM)
            for i, r in enumerate(oom)
        ]
        with_oom = fit_factor(samples + lower_bounds)
        assert base is not None and with_oom is not None
        # The votes are the same; a bound the OOM runs raised can only hold a factor that the
        # shift moved down nearer its median.
        assert with_oom.ratio >= base.ratio
        assert with_oom.upper_ratio >= base.upper_ratio - 1e-12


class TestSafeBoundMargin:
    """The safe bound's margin: a one-sided upper prediction bound on the log ratios, widened
    for few votes, never narrower than the spread floor supports."""

    @pytest.mark.parametrize(
        ("df", "quantile"),
        # One-sided 0.95 critical values of Student's t (NIST/SEMATECH e-Handbook of
        # Statistical Methods, 1.3.6.7.2).
        [(1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (10, 1.812), (30, 1.697), (100, 1.660)],
    )
    def test_student_t_quantiles_match_the_tables(self, df: int, quantile: float) -> None:
        assert student_t_quantile(1 - UPPER_EXCEEDANCE, df) == pytest.approx(quantile, abs=6e-4)

    def test_student_t_tends_to_the_normal_quantile(self) -> None:
        normal = NormalDist().inv_cdf(1 - UPPER_EXCEEDANCE)
        assert normal < student_t_quantile(1 - UPPER_EXCEEDANCE, 5000) < normal + 1e-3
        assert pytest.approx(math.exp(normal * MIN_LOG_SPREAD)) == UPPER_MULTIPLIER_MIN

    def test_four_identical_nodes_are_no_proof_of_zero_spread(self) -> None:
        factor = fit_factor([Sample(voter=f"node-{i}", ratio=1.08) for i in range(4)])
        assert factor is not None
        assert factor.ratio == pytest.approx(1.08) and factor.log_spread == 0.0
        # t(0.95; 3) * 5 % * sqrt(1 + (pi / 2) / 4): a 14.9 % margin, not zero.
        assert factor.upper_multiplier == pytest.approx(1.149, abs=1e-3)
        assert factor.upper_multiplier >= 1.05

    def test_more_agreeing_nodes_narrow_the_margin_down_to_the_floor(self) -> None:
        margins = []
        for nodes in (MIN_NODES, 4, 5, 8, 16, 64, 256):
            factor = fit_factor([Sample(voter=f"n{i}", ratio=1.08) for i in range(nodes)])
            assert factor is not None
            margins.append(factor.upper_multiplier)
        assert margins == sorted(margins, reverse=True)
        assert len(set(margins)) == len(margins)
        assert min(margins) >= UPPER_MULTIPLIER_MIN
        assert margins[-1] == pytest.approx(UPPER_MULTIPLIER_MIN, abs=2e-3)

    @given(spread=st.floats(0.0, 0.5), votes=st.integers(2, 500))
    @settings(max_examples=100, deadline=None)
    def test_the_margin_is_monotone_and_never_below_the_floor(
        self, spread: float, votes: int
    ) -> None:
        margin = upper_prediction_log_margin(spread, votes)
        assert margin >= math.log(UPPER_MULTIPLIER_MIN)
        assert upper_prediction_log_margin(spread, votes + 1) < margin
        assert upper_prediction_log_margin(spread + 0.01, votes) >= margin

    def test_a_wider_spread_of_votes_widens_the_margin(self) -> None:
        tight = fit_factor([Sample(voter=f"n{i}", ratio=1.10) for i in range(5)])
        wide = fit_factor(
            [Sample(voter=f"n{i}", ratio=r) for i, r in enumerate((0.95, 1.02, 1.10, 1.18, 1.26))]
        )
        assert tight is not None and wide is not None
        assert wide.upper_ratio > tight.upper_ratio
        assert wide.upper_ratio > 1.26  # above every node's vote

    def test_a_clamped_factor_keeps_its_margin(self) -> None:
        low = fit_factor([Sample(voter=f"n{i}", ratio=0.5) for i in range(4)])
        assert low is not None and low.ratio == FACTOR_MIN
        assert low.upper_multiplier >= UPPER_MULTIPLIER_MIN
        high = fit_factor([Sample(voter=f"n{i}", ratio=1.45) for i in range(4)])
        assert high is not None
        assert high.upper_ratio >= 1.45 * UPPER_MULTIPLIER_MIN


def jittered(center: float, nodes: int, step: float = 0.01) -> list[Sample]:
    """One run per node at `center` times exp(-step), 1 or exp(step) in turn: a log spread
    of MAD_TO_SIGMA * step whatever the number of nodes (a multiple of three)."""
    return [
        Sample(voter=f"n{i}", ratio=center * math.exp(step * (i % 3 - 1))) for i in range(nodes)
    ]


class TestShiftBeyondNoise:
    """A factor shifts an estimate by what its median shows beyond the median's own standard
    error (SHIFT_Z of them), never across 1, and never lowers the safe bound."""

    def test_votes_that_disagree_as_much_as_they_differ_from_one_shift_nothing(self) -> None:
        rows = [observation(f"n{i}", ratio) for i, ratio in enumerate((1.00, 1.02, 1.04))]
        factor = fit_factor(row.sample for row in rows)
        assert factor is not None
        # Median 1.02, spread 1.4826 * 0.0194 = 0.0288: its standard error, 0.0208, puts 1
        # within a standard error of it.
        assert factor.ratio == 1.0
        prior = estimate(10 * GIB, 11 * GIB, 12 * GIB, 14 * GIB)
        peaks = calibrate(prior, fit_table(rows), model="m", method="lora")
        assert peaks.device_bytes == prior.device_bytes
        # The safe bound still stands over the median: three votes' prediction bound.
        margin = math.exp(upper_prediction_log_margin(factor.log_spread, 3))
        assert factor.upper_ratio == pytest.approx(1.02 * margin)
        assert peaks.device_bytes_upper >= 1.02 * margin * prior.device_bytes

    def test_the_shift_is_the_part_beyond_shift_z_standard_errors(self) -> None:
        spread = MAD_TO_SIGMA * 0.01
        for center in (1.10, 1 / 1.10):
            factor = fit_factor(jittered(center, 3))
            assert factor is not None
            assert factor.log_spread == pytest.approx(spread)
            # sqrt(pi / 2) * 0.0148 / sqrt(3) = 0.0107; 1.96 of them: 2.1 %, toward 1.
            threshold = SHIFT_Z * math.sqrt(math.pi / 2) * spread / math.sqrt(3)
            assert threshold == pytest.approx(0.0211, abs=1e-4)
            toward_one = -math.copysign(threshold, math.log(center))
            assert math.log(factor.ratio) == pytest.approx(math.log(center) + toward_one)

    def test_many_tightly_agreeing_votes_shift_almost_fully(self) -> None:
        ratios = []
        for nodes in (3, 6, 12, 48, 192):
            factor = fit_factor(jittered(1.10, nodes))
            assert factor is not None
            ratios.append(factor.ratio)
        assert ratios == sorted(ratios) and len(set(ratios)) == len(ratios)
        assert ratios[0] < 1.08  # three votes: 2.1 % of the 10 % is within noise
        assert 1.10 * math.exp(-0.003) < ratios[-1] < 1.10  # 192 votes: within 0.3 %

    def test_identical_votes_shift_by_their_whole_median(self) -> None:
        factor = fit_factor([Sample(voter=f"n{i}", ratio=0.9) for i in range(3)])
        assert factor is not None and factor.ratio == 0.9

    @given(
        samples=honest_nodes(low=0.7, high=1.6),
        oom=st.lists(st.floats(0.1, 3.0), max_size=10),
    )
    @settings(max_examples=100, deadline=None)
    def test_the_shift_goes_toward_one_and_never_lowers_the_safe_bound(
        self, samples: list[Sample], oom: list[float]
    ) -> None:
        samples += [
            Sample(voter=samples[i % len(samples)].voter, ratio=r, outcome=Outcome.OOM)
            for i, r in enumerate(oom)
        ]
        factor = fit_factor(samples)
        assert factor is not None
        kept = [
            math.log(vote)
            for node, vote in votes(samples).items()
            if node not in factor.rejected_nodes
        ]
        kept.sort()
        mid = len(kept) // 2
        log_median = kept[mid] if len(kept) % 2 else (kept[mid - 1] + kept[mid]) / 2
        median = min(max(math.exp(log_median), FACTOR_MIN), FACTOR_MAX)
        # Between the median and 1, at most SHIFT_Z standard errors from the median.
        assert min(median, 1.0) - 1e-12 <= factor.ratio <= max(median, 1.0) + 1e-12
        standard_error = math.sqrt(math.pi / 2) * factor.log_spread / math.sqrt(factor.nodes)
        assert abs(math.log(factor.ratio / median)) <= SHIFT_Z * standard_error + 1e-12
        # The safe bound stands over the larger of the median and the factor: the votes'
        # prediction bound, as far as the clamp allows.
        margin = math.exp(upper_prediction_log_margin(factor.log_spread, factor.nodes))
        reference = max(median, factor.ratio)
        assert factor.upper_ratio >= reference * min(margin, UPPER_MULTIPLIER_MAX) * (1 - 1e-12)
        assert factor.upper_multiplier <= UPPER_MULTIPLIER_CEILING


def observation(
    node: str, ratio: float, *, model: str = "m", gpu: str = "A100", environment: str = "e"
) -> Observation:
    return Observation(
        model=model,
        method="lora",
        level=Level.DEVICE,
        gpu=gpu,
        environment=environment,
        sample=Sample(voter=node, ratio=ratio),
    )


class TestFactorTable:
    def test_falls_back_from_model_to_global_to_none(self) -> None:
        rows = [observation(f"n{i}", 1.10, model="big") for i in range(3)]
        rows += [observation("x1", 1.20, model="rare"), observation("x2", 1.20, model="rare")]
        rows += [observation("y1", 1.15, model="third")]  # the global factor needs 3 models
        table = fit_table(rows)

        big = table.lookup(model="big", method="lora", level=Level.DEVICE)
        rare = table.lookup(model="rare", method="lora", level=Level.DEVICE)
        assert big is not None and big.key.scope is Scope.MODEL
        assert rare is not None and rare.key.scope is Scope.GLOBAL
        assert table.lookup(model="big", method="full", level=Level.DEVICE) is None
        assert table.lookup(model="big", method="lora", level=Level.RESERVED) is None
        assert EMPTY_TABLE.lookup(model="big", method="lora", level=Level.DEVICE) is None

    def test_splits_by_gpu_only_where_the_data_show_it_matters(self) -> None:
        rows = [observation(f"a{i}", 1.00 + i / 1000, gpu="A100") for i in range(4)]
        rows += [observation(f"h{i}", 1.20 + i / 1000, gpu="H100") for i in range(4)]
        table = fit_table(rows)
        h100 = table.lookup(model="m", method="lora", level=Level.DEVICE, gpu="H100")
        other = table.lookup(model="m", method="lora", level=Level.DEVICE, gpu="L4")
        assert h100 is not None and h100.key == GroupKey(
            scope=Scope.MODEL_GPU, method="lora", level=Level.DEVICE, model="m", variant="H100"
        )
        assert h100.factor == fit_factor(row.sample for row in rows[4:])
        # Four H100 votes within 0.3 % of each other: the median, 1.2015, shifts by 0.1 %.
        assert h100.factor.ratio == pytest.approx(1.2015, abs=2e-3)
        assert other is not None and other.key.scope is Scope.MODEL

        alike = [observation(f"a{i}", 1.00 + i / 100, gpu="A100") for i in range(4)]
        alike += [observation(f"h{i}", 1.01 + i / 100, gpu="H100") for i in range(4)]
        same = fit_table(alike).lookup(model="m", method="lora", level=Level.DEVICE, gpu="H100")
        assert same is not None and same.key.scope is Scope.MODEL

    def test_splits_by_environment(self) -> None:
        rows = [observation(f"a{i}", 1.00, environment="torch 2.4") for i in range(3)]
        rows += [observation(f"b{i}", 1.25, environment="torch 2.5") for i in range(3)]
        found = fit_table(rows).lookup(
            model="m", method="lora", level=Level.DEVICE, environment="torch 2.5"
        )
        assert found is not None and found.key.scope is Scope.MODEL_ENVIRONMENT
        assert found.factor.ratio == pytest.approx(1.25)


class TestGlobalFactor:
    """A factor reaches other models only when several models agree, each voting once."""

    def test_one_model_however_many_nodes_gives_no_global_factor(self) -> None:
        rows = [observation(f"n{i}", 1.12, model="Qwen/Qwen2.5-7B") for i in range(40)]
        table = fit_table(rows)
        own = table.lookup(model="Qwen/Qwen2.5-7B", method="lora", level=Level.DEVICE)
        assert own is not None and own.key.scope is Scope.MODEL
        assert (
            table.lookup(model="meta-llama/Llama-3.1-8B", method="lora", level=Level.DEVICE) is None
        )
        assert fit_global_factor(rows) is None

    def test_needs_min_models_models(self) -> None:
        rows = [
            observation(f"{model}-{i}", 1.10, model=model)
            for model in ("a", "b", "c")[: MIN_MODELS - 1]
            for i in range(3)
        ]
        assert fit_global_factor(rows) is None
        rows += [observation("d-0", 1.10, model="d")]
        found = fit_global_factor(rows)
        assert found is not None
        assert found.models == MIN_MODELS and found.nodes == 3 * (MIN_MODELS - 1) + 1

    def test_each_model_votes_once(self) -> None:
        # Twenty nodes of one model measure 1.10; two other models, one node each, ~1.0: the
        # median of node votes would be 1.10, agreed on by most nodes, a factor that shifts
        # estimates by 10 %. The models vote 1.10, 1.00 and 1.02: they disagree by as much as
        # their median, 1.02, differs from 1, so the estimates stay as they are.
        rows = [observation(f"big-{i}", 1.10, model="big") for i in range(20)]
        rows += [observation("b", 1.00, model="b"), observation("c", 1.02, model="c")]
        found = fit_global_factor(rows)
        assert found is not None
        assert found.ratio == 1.0
        assert found.models == 3 and found.nodes == 22

    def test_a_model_far_from_the_others_is_rejected(self) -> None:
        rows = [
            observation(f"{m}-{i}", r, model=m)
            for m, r in (("a", 1.00), ("b", 1.02), ("c", 1.04))
            for i in range(2)
        ]
        agreeing = list(rows)
        rows += [observation(f"odd-{i}", 1.45, model="odd") for i in range(3)]
        found = fit_global_factor(rows)
        assert found is not None
        assert found.models == 3 and found.rejected_nodes == ("odd-0", "odd-1", "odd-2")
        # The odd model moves nothing: the factor is the three others' alone.
        assert replace(found, rejected_nodes=()) == fit_global_factor(agreeing)

    def test_needs_min_nodes_nodes_behind_the_models(self) -> None:
        rows = [observation("one-node", 1.10, model=m) for m in ("a", "b", "c", "d")]
        assert fit_global_factor(rows) is None

    def test_the_global_margin_counts_models(self) -> None:
        rows = [
            observation(f"{model}-{i}", 1.10, model=model)
            for model in ("a", "b", "c")
            for i in range(10)
        ]
        found = fit_global_factor(rows)
        assert found is not None
        # Three models, thirty nodes: the bound of one more model is as wide as three votes'.
        assert found.upper_multiplier == pytest.approx(
            math.exp(upper_prediction_log_margin(0.0, MIN_MODELS))
        )


class TestLevelsAreFittedSeparately:
    def test_each_level_has_its_own_factor_from_its_own_ratios(self) -> None:
        rows = []
        for i in range(3):
            for level, ratio in (
                (Level.ALLOCATED, 1.0),
                (Level.RESERVED, 1.05),
                (Level.DEVICE, 1.2),
            ):
                rows.append(replace(observation(f"n{i}", ratio), level=level))
        table = fit_table(rows)
        found = {level: table.lookup(model="m", method="lora", level=level) for level in Level}
        assert {level: f.factor.ratio for level, f in found.items() if f} == pytest.approx(
            {Level.ALLOCATED: 1.0, Level.RESERVED: 1.05, Level.DEVICE: 1.2}
        )

    def test_a_level_nobody_measured_gets_no_factor(self) -> None:
        rows = [observation(f"n{i}", 1.2) for i in range(5)]  # device only
        peaks = calibrate(
            estimate(10 * GIB, 11 * GIB, 12 * GIB, 14 * GIB),
            fit_table(rows),
            model="m",
            method="lora",
        )
        assert set(peaks.applied) == {Level.DEVICE}
        assert (peaks.allocated_bytes, peaks.reserved_bytes) == (10 * GIB, 11 * GIB)


def applied(ratio: float, spread: float = 0.02, upper_multiplier: float = 1.1) -> AppliedFactor:
    factor = fit_factor([Sample(voter=f"n{i}", ratio=ratio) for i in range(3)])
    assert factor is not None
    return AppliedFactor(
        key=GroupKey(scope=Scope.MODEL, method="lora", level=Level.DEVICE, model="m"),
        factor=replace(factor, log_spread=spread, upper_multiplier=upper_multiplier),
    )


class TestFlagOutlier:
    def test_without_a_factor_uses_the_prior_spread(self) -> None:
        assert flag_outlier(1.2, Outcome.COMPLETED, None) is None
        reason = flag_outlier(2.0, Outcome.COMPLETED, None)
        assert reason is not None and "above the uncalibrated estimate" in reason

    def test_against_a_factor(self) -> None:
        factor = applied(1.1, spread=0.05)
        assert flag_outlier(1.15, Outcome.COMPLETED, factor) is None
        reason = flag_outlier(0.7, Outcome.COMPLETED, factor)
        assert reason is not None and "below the model factor 1.100" in reason

    def test_a_low_oom_run_is_not_an_outlier(self) -> None:
        assert flag_outlier(0.3, Outcome.OOM, None) is None
        assert flag_outlier(5.0, Outcome.OOM, None) is not None


def estimate(allocated: int, reserved: int, device: int, upper: int) -> Estimate:
    return Estimate(
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        device_bytes=device,
        device_bytes_upper=upper,
        components={},
        overheads={},
        peak_step=2,
        peak_phase=Phase.BACKWARD_START,
        phases=(),
        params=ParamCounts(total=1, trainable=1),
        upper_margin=upper / device - 1,
        assumptions=(),
        warnings=(),
        estimator_version="test",
    )


class TestCalibrate:
    def test_without_factors_the_estimate_stands(self) -> None:
        prior = estimate(10 * GIB, 11 * GIB, 12 * GIB, 14 * GIB)
        peaks = calibrate(prior, EMPTY_TABLE, model="m", method="lora")
        assert (peaks.allocated_bytes, peaks.reserved_bytes) == (10 * GIB, 11 * GIB)
        assert (peaks.device_bytes, peaks.device_bytes_upper) == (12 * GIB, 14 * GIB)
        assert peaks.applied == {}

    def test_applies_each_level_and_the_upper_multiplier(self) -> None:
        device = applied(1.25, upper_multiplier=1.2)
        table = FactorTable({device.key: device.factor})
        peaks = calibrate(
            estimate(10 * GIB, 11 * GIB, 12 * GIB, 14 * GIB), table, model="m", method="lora"
        )
        assert peaks.allocated_bytes == 10 * GIB
        assert peaks.device_bytes == 15 * GIB
        assert peaks.device_bytes_upper == 18 * GIB
        assert set(peaks.applied) == {Level.DEVICE}

    def test_a_calibrator_is_found_once_per_table_and_matches_the_lookups(self) -> None:
        device = applied(1.25)
        table = FactorTable({device.key: device.factor})
        first = table.calibrator(model="m", method="lora", gpu="A100-80GB")
        assert table.calibrator(model="m", method="lora", gpu="A100-80GB") is first
        for level in Level:
            assert first.applied.get(level) == table.lookup(
                model="m", method="lora", level=level, gpu="A100-80GB"
            )
        assert table.calibrator(model="other", method="lora").applied == {}

    def test_the_calibrator_memo_is_bounded(self) -> None:
        table = FactorTable({})
        for i in range(CALIBRATOR_MEMO_ENTRIES + 10):
            table.calibrator(model="m", method="lora", gpu=f"gpu-{i}")
        assert len(table._calibrators) <= CALIBRATOR_MEMO_ENTRIES

    def test_keeps_the_levels_ordered(self) -> None:
        shrink = applied(FACTOR_MIN)
        key = replace(shrink.key, level=Level.RESERVED)
        table = FactorTable({key: shrink.factor})
        peaks = calibrate(
            estimate(10 * GIB, 10 * GIB, 12 * GIB, 14 * GIB), table, model="m", method="lora"
        )
        assert peaks.allocated_bytes <= peaks.reserved_bytes <= peaks.device_bytes
        assert peaks.reserved_bytes == 10 * GIB

    def test_four_identical_nodes_leave_a_safe_bound_above_the_measured_peak(self) -> None:
        # The issue: four identical uploads of one job from four nodes.
        prior = estimate(30 * GIB, 31 * GIB, 32 * GIB, 35 * GIB)
        measured = 34 * GIB
        rows = [observation(f"node-{i}", measured / prior.device_bytes) for i in range(4)]
        peaks = calibrate(prior, fit_table(rows), model="m", method="lora")
        assert peaks.device_bytes >= measured
        assert peaks.device_bytes_upper >= 1.05 * peaks.device_bytes
        assert peaks.device_bytes_upper > measured
        other = calibrate(prior, fit_table(rows), model="another family", method="lora")
        assert other == calibrate(prior, EMPTY_TABLE, model="another family", method="lora")
