"""The kernel-level probe: the paper's bias appears where it should, and the stabilized rules cut it."""
import pytest
import torch

from stableflash.diagnostics.mechanism import ProbeConfig, make_inputs, run_probe
from stableflash.attention import reference


@pytest.fixture(scope="module")
def probe():
    seed = int(torch.randint(0, 2**31 - 1, (1,)))      # fresh inputs each run; printed on failure
    cfg = ProbeConfig(batch=2, heads=4, seq_len=256, seed=seed)
    result = run_probe(cfg)
    rows = {(r["policy"], r["rule"], r["inputs"]): r for r in result["rows"]}
    return cfg, rows, seed


def test_inputs_have_the_structure_described(probe):
    cfg = ProbeConfig(batch=1, heads=2, seq_len=128, seed=3)
    g = torch.Generator().manual_seed(3)
    for kind in ("tied", "tied-split", "control"):
        x = make_inputs(cfg, kind, g)
        s = reference.scores(x["q"], x["k"])
        top = s.topk(cfg.ties, dim=-1).values
        gaps = top[..., 0] - top[..., -1]
        if kind == "control":
            assert (gaps >= 0.4).all()
        else:
            assert (gaps == 0).all()                         # every row: `ties` exactly equal maxima
            assert (top[..., 0] > cfg.max_logit - 1).all()   # ... well above the rest
        assert (x["v"][..., : cfg.head_dim // 2] < 0).all() and (x["do"][..., : cfg.head_dim // 2] <= 0).all()


def test_standard_paper_policy_is_biased_on_tied_rows(probe):
    cfg, rows, seed = probe
    r = rows[("paper", "standard", "tied")]
    assert r["pbar_one_frac"] == pytest.approx(cfg.ties / cfg.seq_len, rel=1e-12), seed
    assert r["o_err_ulp"] < -0.15, seed            # O pushed more negative in V's negative features
    assert r["delta_err_mean"] > 0.03 and r["delta_err_t"] > 10, seed   # δ_lp − δ_hp biased positive


@pytest.mark.parametrize("rule", ["paper", "tie-shift", "all-shift"])
def test_stabilized_rules_cut_the_bias(probe, rule):
    cfg, rows, seed = probe
    base, r = rows[("paper", "standard", "tied")], rows[("paper", rule, "tied")]
    assert r["pbar_one_frac"] == 0.0, seed
    assert abs(r["o_err_ulp"]) < abs(base["o_err_ulp"]) / 4, seed
    assert abs(r["delta_err_mean"]) < base["delta_err_mean"] / 4, seed


def test_ties_across_key_blocks_escape_the_paper_rule_but_not_ours(probe):
    cfg, rows, seed = probe
    base = rows[("paper", "standard", "tied-split")]
    paper, ours = rows[("paper", "paper", "tied-split")], rows[("paper", "tie-shift", "tied-split")]
    assert paper["pbar_one_frac"] == base["pbar_one_frac"] > 0, seed
    assert paper["delta_err_t"] > 10, seed
    assert ours["pbar_one_frac"] == 0.0, seed
    assert abs(ours["delta_err_mean"]) < base["delta_err_mean"] / 2, seed


def test_controls_show_no_clear_bias(probe):
    cfg, rows, seed = probe
    for policy in ("paper", "fa2"):
        for rule in ("standard", "paper", "tie-shift"):
            assert abs(rows[(policy, rule, "control")]["delta_err_t"]) < 5, (policy, rule, seed)


def test_fa2_with_our_rules_shows_no_clear_bias(probe):
    cfg, rows, seed = probe
    for rule in ("tie-shift", "all-shift"):
        for kind in ("tied", "tied-split", "control"):
            assert abs(rows[("fa2", rule, kind)]["delta_err_t"]) < 5, (rule, kind, seed)


@pytest.mark.parametrize("kwargs,match", [({"ties": 1}, "ties=1"), ({"groups": 0}, "groups=0"),
                                          ({"head_dim": 8}, "head_dim=8"), ({"beta": 1.0}, "beta=1.0"),
                                          ({"low": "bf17"}, "bf17"), ({"max_logit": -1.0}, "max_logit=-1.0"),
                                          ({"seq_len": 8, "groups": 8}, "do not fit")])
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProbeConfig(**kwargs)
