"""kernels/sampling.py: the fused Triton sampler against its torch reference, and the reference
against a naive sort-based oracle written here. On CPU the kernel runs in the interpreter, so
shapes stay small."""

import dataclasses
from collections import Counter

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICES
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.kernels.sampling import _uniform, sample
from kiln.kernels.sampling_metadata import SamplingMetadata
from kiln.kernels.sampling_ref import philox_uniform_ref, sample_ref, unpack_bitmask

NEG_INF = float("-inf")
ROW_DEFAULTS = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, rep=1.0, freq=0.0, pres=0.0,
                    seed=0, step=0)


def make_metadata(rows, device, window=None, bitmask=None, num_top=0) -> SamplingMetadata:
    rows = [{**ROW_DEFAULTS, **r} for r in rows]
    col = lambda key, dtype: torch.tensor([r[key] for r in rows], dtype=dtype, device=device)
    return SamplingMetadata(
        temperature=col("temperature", torch.float32), top_k=col("top_k", torch.int32),
        top_p=col("top_p", torch.float32), min_p=col("min_p", torch.float32),
        repetition_penalty=col("rep", torch.float32), frequency_penalty=col("freq", torch.float32),
        presence_penalty=col("pres", torch.float32),
        window_token_ids=None if window is None else window.to(device),
        seeds=col("seed", torch.int64), offsets=col("step", torch.int64),
        grammar_bitmask=None if bitmask is None else bitmask.to(device),
        num_top_logprobs=num_top)


def select_rows(md: SamplingMetadata, idx: list[int]) -> SamplingMetadata:
    pick = lambda t: None if t is None else t[idx].contiguous()
    return SamplingMetadata(
        pick(md.temperature), pick(md.top_k), pick(md.top_p), pick(md.min_p),
        pick(md.repetition_penalty), pick(md.frequency_penalty), pick(md.presence_penalty),
        pick(md.window_token_ids), pick(md.seeds), pick(md.offsets), pick(md.grammar_bitmask),
        md.num_top_logprobs)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V / 32)] int32, bit j of word w allows token 32 * w + j."""
    B, V = allowed.shape
    padded = torch.zeros(B, triton.cdiv(V, 32) * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    words = (padded.view(B, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def mixed_batch(V: int, device, num_top=3):
    """Rows mixing greedy / penalised / top-k / top-p / min-p / masked settings."""
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(10, V, generator=gen) * 3
    rows = [
        dict(temperature=0.0, rep=1.3, freq=0.4, pres=0.2),       # greedy, penalised
        dict(temperature=0.8, top_k=1),                             # greedy through top_k = 1
        dict(temperature=1.0),                                      # plain temperature
        dict(temperature=0.7, top_k=7, rep=1.1),                    # top-k
        dict(temperature=1.2, top_p=0.8),                           # top-p
        dict(temperature=1.0, min_p=0.1, pres=0.5),                 # min-p
        dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, rep=1.5, freq=0.3),
        dict(temperature=1.0, top_p=0.95),                          # grammar-masked
        dict(temperature=0.5, top_k=V + 5),                         # top_k >= V: off
        dict(temperature=2.0, top_k=3, rep=2.0, freq=5.0),          # only token 5 allowed
    ]
    for i, r in enumerate(rows):
        r.update(seed=1000 + 17 * i, step=i)
    window = torch.randint(0, V, (10, 24), generator=gen)
    window[:, 16:] = -1                       # padding
    window[:, 8:12] = window[:, :4]           # repeats
    allowed = torch.ones(10, V, dtype=torch.bool)
    allowed[7] = torch.rand(V, generator=gen) < 0.3
    allowed[9] = False
    allowed[9, 5] = True
    window[9, :3] = 5                         # penalised hard, still the only choice
    md = make_metadata(rows, device, window, pack_bitmask(allowed), num_top)
    return logits.to(device), md, allowed.to(device)


def assert_same_processed(got: torch.Tensor, want: torch.Tensor):
    assert torch.equal(got.isinf(), want.isinf()), (
        f"survivor sets differ at {(got.isinf() != want.isinf()).nonzero()[:5].tolist()}")
    finite = ~want.isinf()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.softmax(-1), want.softmax(-1), atol=1e-6, rtol=1e-5,
                               equal_nan=True)  # NaN: a row with every token masked


@triton.jit
def _uniform_probe_kernel(seed_ptr, step_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = _uniform(tl.load(seed_ptr), tl.load(step_ptr), offs)
    tl.store(out_ptr + offs, u, mask=offs < n)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,step", [(0, 0), (123456789, 5), (-7, 2**33 + 9),
                                       (2**62 + 12345, 2**31 + 3)])
def test_uniforms_are_bit_identical_to_philox_reference(device, seed, step):
    n = 262144
    seeds = torch.tensor([seed], device=device)
    steps = torch.tensor([step], device=device)
    out = torch.empty(n, device=device)
    _uniform_probe_kernel[(triton.cdiv(n, 65536),)](seeds, steps, out, n, BLOCK=65536)
    ref = philox_uniform_ref(seeds.expand(n), steps.expand(n), torch.arange(n, device=device))
    bad = (out != ref).nonzero()
    assert bad.numel() == 0, f"first mismatch at token {bad[0].item()}"
    assert 0.0 <= out.min() and out.max() < 1.0 and abs(out.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V,dtype,tile", [(1000, torch.float32, 256),
                                             (4099, torch.float32, 1024),
                                             (1000, torch.bfloat16, 512)])
def test_kernel_matches_reference_on_mixed_rows(device, V, dtype, tile):
    logits, md, _ = mixed_batch(V, device)
    logits = logits.to(dtype)
    got = sample(logits, md, return_processed=True, tile=tile)
    want = sample_ref(logits, md, return_processed=True)
    assert_same_processed(got.processed_logits, want.processed_logits)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    assert got.top_token_ids.tolist() == want.top_token_ids.tolist()
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_row_tokens_do_not_depend_on_batch_composition(device):
    logits, md, _ = mixed_batch(300, device, num_top=0)
    full = sample(logits, md, tile=128)  # 3 tiles a row
    order = [9, 4, 0, 6]
    part = sample(logits[order], select_rows(md, order), tile=128)
    assert part.token_ids.tolist() == [full.token_ids[i].item() for i in order]
    assert torch.equal(part.logprobs, full.logprobs[order])  # the same bits
    alone = sample(logits[[6]], select_rows(md, [6]), tile=128)
    assert alone.token_ids.tolist() == [full.token_ids[6].item()]
    assert torch.equal(alone.logprobs, full.logprobs[[6]])
    assert torch.equal(sample(logits, md, tile=128).token_ids, full.token_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_thresholds_from_candidates_and_from_whole_rows(device):
    """12 tiles a row: top_k and top_p thresholds the tiles' candidates decide, and those
    they cannot (top_k above the candidates, a nucleus wider than all of them, ties at a
    tile's last candidate), which the whole row decides; the same survivors, tokens and
    logprobs as the reference."""
    V, tile = 3000, 256
    gen = torch.Generator().manual_seed(7)
    scale = torch.tensor([3.0, 3.0, 3.0, 3.0, 0.05, 3.0, 3.0, 2.0, 2.0, 3.0, 1, 1])[:, None]
    logits = torch.randn(12, V, generator=gen) * scale
    logits[7:9] = (logits[7:9] * 2).round() / 2  # many ties everywhere
    logits[10, :tile] += 10.0                   # the 80 largest in one tile
    logits[11, 100:110], logits[11, 110:180] = 8.0, 5.0  # 70 ties past a tile's candidates
    rows = [dict(temperature=0.9, top_k=5), dict(temperature=1.1, top_k=64),
            dict(temperature=1.0, top_k=65), dict(temperature=1.0, top_k=300, top_p=0.97),
            dict(temperature=1.0, top_p=0.99),                   # nucleus of ~2,900 tokens
            dict(temperature=0.8, top_p=0.6), dict(temperature=0.7, top_k=50, top_p=0.9,
                                                   min_p=0.01, rep=1.3, freq=0.2),
            dict(temperature=1.0, top_k=40), dict(temperature=1.0, top_p=0.8),
            dict(temperature=1.2, top_k=20, top_p=0.95, pres=0.4),
            dict(temperature=1.0, top_k=80), dict(temperature=1.0, top_k=20, top_p=0.76)]
    for i, r in enumerate(rows):
        r.update(seed=31 * i, step=i)
    window = torch.randint(0, V, (12, 40), generator=gen)
    window[10:] = -1
    allowed = torch.rand(12, V, generator=gen) < 0.9
    allowed[10:] = True
    md = make_metadata(rows, device, window, pack_bitmask(allowed), num_top=5)
    logits = logits.to(device)
    got = sample(logits, md, return_processed=True, tile=tile)
    want = sample_ref(logits, md, return_processed=True)
    assert_same_processed(got.processed_logits, want.processed_logits)
    kept = (~want.processed_logits.isinf()).sum(-1).tolist()
    assert kept[4] > (V // tile + 1) * 64 and kept[10] == 80 and kept[11] == 80
    assert got.token_ids.tolist() == want.token_ids.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    # Tied logits may come in another order than torch.topk's: compare what they pick.
    assert torch.equal(logits.gather(1, got.top_token_ids), logits.gather(1, want.top_token_ids))
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_first_argmax_of_penalised_masked_logits(device):
    V = 700
    logits = torch.randn(3, V) - 5
    logits[:, [3, 650]] = 4.0                 # tie across blocks: the lower id wins
    logits[1, 3] = 10.0                       # penalised below the runner-up
    window = torch.full((3, 4), -1)
    window[1, :2] = 3
    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[2, 3] = False
    md = make_metadata([dict(temperature=0.0), dict(temperature=0.0, rep=4.0, freq=1.0),
                        dict(temperature=0.3, top_k=1)], device, window, pack_bitmask(allowed))
    got = sample(logits.to(device), md, tile=256).token_ids.tolist()
    assert got == [3, 3 if 10.0 / 4 - 2 > 4 else 650, 650]
    assert sample_ref(logits.to(device), md).token_ids.tolist() == got


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_the_contract_formula(device):
    V = 64
    logits = torch.linspace(-2, 2, V).repeat(3, 1)
    logits[:, 5], logits[:, 7], logits[:, 9], logits[:, 63] = 2.0, -1.5, 0.0, 0.5
    window = torch.tensor([[5, 5, 7, -1, 9, 5, 63, -1]] * 2 + [[-1] * 8])
    md = make_metadata([dict(temperature=0.0, rep=2.0, freq=0.25, pres=0.5),
                        dict(temperature=0.0), dict(temperature=0.0, rep=3.0, pres=1.0)],
                       device, window)
    want = logits.clone()
    # c(5) = 3: 2 / 2 - (3 * 0.25 + 0.5); c = 1 for 7 (<= 0: times rep), 9 (zero) and 63.
    want[0, 5], want[0, 7], want[0, 9], want[0, 63] = -0.25, -3.75, -0.75, -0.5
    for fn in (sample, sample_ref):
        got = fn(logits.to(device), md, return_processed=True).processed_logits.cpu()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_before_penalties_mask_and_temperature(device):
    logits, md, _ = mixed_batch(1000, device, num_top=20)
    out = sample(logits, md, tile=1024)
    raw_lp = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out.logprobs, raw_lp.gather(1, out.token_ids[:, None])[:, 0],
                               atol=1e-5, rtol=1e-5)
    top_vals, top_ids = torch.topk(raw_lp, 20, dim=-1)
    assert out.top_token_ids.tolist() == top_ids.tolist()
    torch.testing.assert_close(out.top_logprobs, top_vals, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_tokens_stay_inside_the_filtered_set(device):
    V, B = 40, 96
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(1, V, generator=gen) * 2).repeat(B, 1)
    allowed = (torch.rand(1, V, generator=gen) < 0.6).repeat(B, 1)
    rows = [dict(temperature=1.5, top_k=[0, 6, 0, 12][i % 4], top_p=[0.7, 1.0, 1.0, 0.9][i % 4],
                 min_p=[0.0, 0.0, 0.2, 0.05][i % 4], seed=i, step=3) for i in range(B)]
    md = make_metadata(rows, device, bitmask=pack_bitmask(allowed))
    got = sample(logits.to(device), md)
    want = sample_ref(logits.to(device), md, return_processed=True)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    kept = ~want.processed_logits.isinf()
    assert bool(kept.gather(1, got.token_ids[:, None]).all())
    assert bool(allowed.to(device).gather(1, got.token_ids[:, None]).all())
    for i, r in enumerate(rows[:4]):  # the oracle's survivor sets
        oracle = oracle_processed(logits[i], r, allowed[i], Counter())
        assert torch.equal(kept[i].cpu(), ~oracle.isinf())


def _total_variation(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(tokens.cpu(), minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * (freq - probs.cpu().double()).abs().sum().item()


@pytest.mark.parametrize("device", DEVICES)
def test_empirical_frequencies_match_reference_probabilities(device):
    V = 12
    logits = torch.linspace(-1.5, 2.0, V)[None]
    setting = dict(temperature=0.9, top_k=8, top_p=0.95, min_p=0.03)
    probs = oracle_processed(logits[0], {**ROW_DEFAULTS, **setting}, torch.ones(V, dtype=bool),
                             Counter()).softmax(-1)
    # Reference: 20,000 seeded draws (steps of one stream); chi-square at p = 0.001.
    n = 20000
    md = make_metadata([dict(setting, seed=42, step=s) for s in range(n)], device)
    ref_tokens = sample_ref(logits.expand(n, V).to(device), md).token_ids
    freq = torch.bincount(ref_tokens.cpu(), minlength=V).double()
    expected = probs.double() * n
    nz = expected > 0
    assert freq[~nz].sum() == 0
    chi2 = ((freq[nz] - expected[nz]) ** 2 / expected[nz]).sum().item()
    critical = {4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[int(nz.sum()) - 1]  # by df
    assert chi2 < critical, (chi2, critical)
    # Kernel: the same stream token for token, and its own frequencies close on 160 draws.
    k = 160
    got = sample(logits.expand(k, V).to(device), select_rows(md, list(range(k)))).token_ids
    assert got.tolist() == ref_tokens[:k].tolist()
    assert _total_variation(got, probs) < 0.15


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_keeps_every_token_tied_with_the_kth(device):
    logits = torch.tensor([[5.0, 3.0, 4.0, 3.0, 1.0, 3.0, 0.0, -1.0, 2.0]])
    md = make_metadata([dict(top_k=3)], device)
    for fn in (sample, sample_ref):
        kept = ~fn(logits.to(device), md, return_processed=True).processed_logits.isinf()
        assert kept.nonzero()[:, 1].tolist() == [0, 1, 2, 3, 5]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [151936, 262144])
def test_large_vocab_rows(device, V):
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(2, V, generator=gen).to(device)
    md = make_metadata([dict(temperature=0.0), dict(temperature=0.8, top_k=40, top_p=0.9,
                                                    seed=9, step=77)], device, num_top=2)
    got, want = sample(logits, md), sample_ref(logits, md)
    assert got.token_ids.tolist() == want.token_ids.tolist()
    assert got.token_ids[0].item() == logits[0].argmax().item()
    assert got.top_token_ids.tolist() == want.top_token_ids.tolist()


def test_metadata_flags_and_validation():
    md = make_metadata([dict(temperature=0.0, top_p=0.5), dict(temperature=1.0, top_k=1)], "cpu")
    assert md.all_greedy and not (md.has_top_k or md.has_top_p or md.has_min_p)
    md = make_metadata([dict(top_k=5), dict(min_p=0.1)], "cpu")
    assert md.has_top_k and md.has_min_p and not (md.all_greedy or md.has_top_p)
    assert not (md.has_penalties or md.has_grammar)
    for bad in (dict(top_p=0.0), dict(temperature=-1.0), dict(min_p=1.5), dict(rep=0.0)):
        with pytest.raises(ValueError, match="out of range"):
            make_metadata([bad], "cpu")
    with pytest.raises(ValueError, match="num_top_logprobs"):
        make_metadata([{}], "cpu", num_top=21)


# --- the reference against an independent oracle: python loops, a full sort, float64 ------

def oracle_processed(raw: torch.Tensor, r: dict, allowed: torch.Tensor, counts: Counter):
    """One row, written from the contract: logits the draw sees, -inf where filtered."""
    x = raw.double().clone()
    for t, c in counts.items():
        x[t] = x[t] * r["rep"] if x[t] <= 0 else x[t] / r["rep"]
        x[t] -= c * r["freq"] + r["pres"]
    x[~allowed] = NEG_INF
    if r["temperature"] == 0 or r["top_k"] == 1:
        return x.float()
    order = sorted(range(x.numel()), key=lambda j: -x[j].item())
    keep = x > NEG_INF
    if 0 < r["top_k"] < x.numel():
        keep &= x >= x[order[r["top_k"] - 1]]
    probs = torch.where(keep, x, NEG_INF).softmax(-1)
    if r["top_p"] < 1 and bool(keep.any()):
        mass, last = 0.0, None
        for j in order:
            if keep[j]:
                mass, last = mass + probs[j].item(), x[j].item()
                if mass >= r["top_p"]:
                    break
        keep &= x >= last
    keep &= probs >= r["min_p"] * probs.max()
    return torch.where(keep, x / r["temperature"], NEG_INF).float()


@settings(max_examples=40, deadline=None, derandomize=True)
@given(V=st.integers(2, 300), data_seed=st.integers(0, 2**31), temperature=st.sampled_from(
    [0.0, 0.5, 1.0]), top_k=st.sampled_from([0, 1, 2, 5, 40, 400]), top_p=st.sampled_from(
    [1.0, 0.95, 0.7, 0.3]), min_p=st.sampled_from([0.0, 0.05, 0.3]), penalised=st.booleans(),
    masked=st.booleans())
def test_reference_matches_sort_based_oracle(V, data_seed, temperature, top_k, top_p, min_p,
                                             penalised, masked):
    gen = torch.Generator().manual_seed(data_seed)
    logits = torch.randn(2, V, generator=gen) * 2
    window = torch.randint(-1, V, (2, 16), generator=gen) if penalised else None
    allowed = torch.rand(2, V, generator=gen) < 0.5 if masked else torch.ones(2, V, dtype=bool)
    rows = [dict(ROW_DEFAULTS, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                 rep=1.3, freq=0.2, pres=0.1, seed=i) for i in range(2)]
    md = make_metadata(rows, "cpu", window, pack_bitmask(allowed) if masked else None)
    out = sample_ref(logits, md, return_processed=True)
    for i in range(2):
        counts = Counter(t for t in window[i].tolist() if t >= 0) if penalised else Counter()
        want = oracle_processed(logits[i], rows[i], allowed[i], counts)
        assert_same_processed(out.processed_logits[i], want)
        assert want[out.token_ids[i]] > NEG_INF or not bool((want > NEG_INF).any())


def test_unpack_bitmask_round_trips():
    allowed = torch.rand(3, 77) < 0.5
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 77), allowed)


def with_bias(md: SamplingMetadata, biases: list[dict[int, float]], device) -> SamplingMetadata:
    """md plus a logit_bias per row ({token: bias}; -inf bans), -1 padded to one width."""
    width = max(len(b) for b in biases)
    ids = torch.full((len(biases), width), -1, dtype=torch.int64)
    values = torch.zeros((len(biases), width), dtype=torch.float32)
    for i, b in enumerate(biases):
        ids[i, :len(b)] = torch.tensor(list(b), dtype=torch.int64)
        values[i, :len(b)] = torch.tensor(list(b.values()), dtype=torch.float32)
    return dataclasses.replace(md, bias_token_ids=ids.to(device), bias_values=values.to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_is_added_after_penalties_and_before_the_mask(device):
    V = 64
    logits = torch.linspace(-2, 2, V).repeat(3, 1)
    logits[:, 5] = 2.0
    window = torch.tensor([[5, 5, -1, -1]] * 3)
    allowed = torch.ones(3, V, dtype=torch.bool)
    allowed[:, 40] = False
    md = make_metadata([dict(temperature=0.0, rep=2.0, pres=0.5),
                        dict(temperature=0.0), dict(temperature=0.0, freq=1.0)],
                       device, window, pack_bitmask(allowed))
    md = with_bias(md, [{5: 3.0, 7: -100.0, 40: 100.0}, {}, {63: float("-inf"), 0: 0.25}],
                   device)
    want = logits.clone()
    want[0, 5] = 2.0 / 2.0 - 0.5 + 3.0             # penalised, then biased
    want[0, 7] += -100.0
    want[2, 5] = 2.0 - 2 * 1.0                      # c(5) = 2
    want[2, 63], want[2, 0] = float("-inf"), want[2, 0] + 0.25
    want[:, 40] = float("-inf")                     # the mask wins over any bias
    for fn in (sample, sample_ref):
        out = fn(logits.to(device), md, return_processed=True)
        torch.testing.assert_close(out.processed_logits.cpu(), want, atol=1e-6, rtol=0)
        assert out.token_ids.tolist() == [5, 5, 62]  # row 1: 5 ties 63 (lower id); 63 banned


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_matches_reference_with_logit_bias(device):
    V = 1000
    logits, md, _ = mixed_batch(V, device)
    gen = torch.Generator().manual_seed(3)
    biases = []
    for i in range(10):
        toks = torch.randperm(V, generator=gen)[:[0, 3, 40, 130][i % 4]].tolist()
        bias = {t: float(torch.empty(1).uniform_(-100, 100, generator=gen)) for t in toks}
        if i % 3 == 0:  # ban the row's top raw token (min_tokens on a stop token)
            bias[int(logits[i].argmax())] = float("-inf")
        biases.append(bias)
    for window_too in (True, False):
        m = md if window_too else dataclasses.replace(md, window_token_ids=None)
        m = with_bias(m, biases, device)
        got = sample(logits, m, return_processed=True, tile=256)
        want = sample_ref(logits, m, return_processed=True)
        assert_same_processed(got.processed_logits, want.processed_logits)
        assert got.token_ids.tolist() == want.token_ids.tolist()
        for i in range(0, 10, 3):
            assert got.token_ids[i].item() != logits[i].argmax().item() or i == 9


@pytest.mark.parametrize("V", [1000, 49152])
@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.6])
def test_the_cpu_samplers_c_kernels_draw_what_torch_draws(V, top_p):
    """runtime/backends/cpu/race.py (the CPU sampler's draw over whole rows when no row has
    top_k: top_p's threshold, then the race) against sample_ref's torch path: the same token
    for every row, over many seeds and steps, with penalties, a grammar mask, min_p and a
    greedy row in the batch."""
    from kiln.runtime.backends.cpu.race import CpuDraw

    logits, md, allowed = mixed_batch(V, "cpu", num_top=3)
    md = select_rows(md, [0, 2, 5, 7, 9])  # greedy, plain, min-p, masked, one token allowed
    md.top_p[:], md.top_k[:] = top_p, 0
    logits = logits[[0, 2, 5, 7, 9]]
    calls = []

    class Counted(CpuDraw):
        def race(self, *args):
            calls.append(1)
            return CpuDraw.race(*args)

    for step in range(40):
        md.seeds += 7919
        md.offsets += step
        want = sample_ref(logits, md)
        got = sample_ref(logits, md, cpu=Counted())
        assert torch.equal(got.token_ids, want.token_ids), step
        # logprobs from the C kernels' log-sum-exp, not torch's log_softmax: ulps apart
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=2e-6, rtol=2e-6)
        assert torch.equal(got.top_token_ids, want.top_token_ids)
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=2e-6, rtol=2e-6)
    assert len(calls) == 40
    assert got.token_ids[4] == 5  # the only token its grammar allows


def test_the_c_top_p_threshold_is_torchs():
    """The threshold itself: the value of the token whose running mass, largest first,
    reaches top_p of the whole (its equals kept), against a sort in float64."""
    from kiln.runtime.backends.cpu.race import top_p_threshold

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 5000, generator=gen) * 2
    x[3, 100:400] = 1.5  # a wide tie across the crossing
    x[4, :4990] = float("-inf")  # few finite tokens
    m = x.max(-1).values
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 0.999, 0.3, 0.7, 0.2, 0.8, 1.0, 0.6])
    thr = top_p_threshold(x, m, top_p)
    for r in range(12):
        if top_p[r] >= 1:
            assert thr[r] == float("-inf")
            continue
        vals = x[r].double().sort(descending=True).values
        vals = vals[vals > float("-inf")]
        mass = torch.exp(vals - m[r].double())
        crossing = int((mass.cumsum(0) < top_p[r].double() * mass.sum()).sum())
        assert thr[r].item() == vals[crossing].item(), r


def test_the_c_row_stats_are_log_softmaxs():
    """The CPU sampler's max, argmax (the first of equals) and log-sum-exp, against torch."""
    from kiln.runtime.backends.cpu.race import row_stats

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 49157, generator=gen) * 4  # a tail past the 16 lanes
    x[2, 7], x[2, 900] = 50.0, 50.0  # a tie: the first wins
    x[3, :100] = float("-inf")
    m, argmax, log_sum = row_stats(x)
    assert torch.equal(m, x.max(-1).values) and argmax[2] == 7
    assert torch.equal(argmax, x.argmax(-1))
    want = torch.log_softmax(x.double(), -1)
    got = (x - m[:, None]) - log_sum[:, None]
    finite = x > float("-inf")
    torch.testing.assert_close(got[finite], want[finite].float(), atol=1e-5, rtol=1e-6)
