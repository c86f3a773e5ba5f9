"""The definitions every backend follows (attention/masking.py): visibility and dropout's bits."""
import pytest
import torch

from stableflash.attention.masking import (Alignment, Masking, Window, drop_threshold, dropout_keep, philox,
                                           visible)


def brute_visible(n_q, n_k, causal, align, left, right):
    off = n_k - n_q if align == "bottom-right" else 0
    rows = []
    for i in range(n_q):
        row = []
        for j in range(n_k):
            ok = True
            if causal and j > i + off:
                ok = False
            if right is not None and j > i + off + right:
                ok = False
            if left is not None and j < i + off - left:
                ok = False
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("n_q,n_k", [(2, 5), (5, 2), (7, 7), (1, 10)])
@pytest.mark.parametrize("align", ["top-left", "bottom-right"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (0, 0), (2, None), (None, 1), (3, 2)])
def test_visible_matches_the_definition(n_q, n_k, align, causal, window):
    w = Window.parse(window)
    got = visible(n_q, n_k, Masking(causal, Alignment.parse(align), w))
    assert torch.equal(got, brute_visible(n_q, n_k, causal, align, w.left, w.right))


def test_docstring_example_and_decoding():
    tl = visible(2, 5, Masking(True, Alignment.TOP_LEFT))
    br = visible(2, 5, Masking(True, Alignment.BOTTOM_RIGHT))
    assert tl.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert br.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # one decode query over 10 cached keys sees all of them bottom-right, only key 0 top-left
    assert visible(1, 10, Masking(True, Alignment.BOTTOM_RIGHT)).all()
    assert visible(1, 10, Masking(True, Alignment.TOP_LEFT)).sum() == 1


@pytest.mark.parametrize("value,message", [((1,), "window=\\(1,\\) is invalid"), ((-2, 0), "is invalid"),
                                           ((1.5, 0), "is invalid"), ((True, 0), "is invalid"), ("ab", "is invalid")])
def test_bad_windows_are_named(value, message):
    with pytest.raises(ValueError, match=message):
        Window.parse(value)


def test_flash_attention_style_windows_take_minus_one():
    assert Window.parse((-1, 0), "window_size", unbounded=(None, -1)) == Window(None, 0)
    with pytest.raises(ValueError, match="align='diagonal' is invalid"):
        Alignment.parse("diagonal")


def test_philox_matches_known_answer_and_triton():
    # Random123's known-answer test for philox4x32-10: counter and key all 0xFFFFFFFF
    full = torch.tensor(0xFFFFFFFF)
    out = philox(0xFFFFFFFF_FFFFFFFF, full, full, full, full)
    assert [int(x) for x in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    zero = torch.tensor(0)
    assert [int(x) for x in philox(0, zero, zero, zero, zero)] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_dropout_keeps_about_one_minus_p_and_depends_on_every_coordinate():
    heads = torch.arange(6)
    keep = dropout_keep(1234, 0.25, heads, 64, 96)
    assert keep.shape == (6, 64, 96)
    frac = keep.float().mean().item()
    assert abs(frac - 0.75) < 0.01                  # 36864 draws: 4.4 standard deviations is 0.01
    assert not torch.equal(keep[0], keep[1])
    assert not torch.equal(keep, dropout_keep(1235, 0.25, heads, 64, 96))
    assert torch.equal(keep, dropout_keep(1234, 0.25, heads, 64, 96))
    assert drop_threshold(0.0) == 0 and dropout_keep(7, 0.0, heads, 3, 3).all()
