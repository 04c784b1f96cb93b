"""`BertLMHeadModel.generate` and the `KVCache` against transformers in the same run, on tiny
random decoders: greedy tokens equal transformers' `generate` token for token (one prompt,
a batch, a left-padded batch, with and without the cache, sdpa and eager); a cached step's
logits equal recomputing the whole prefix (and, in exact mode, transformers' cached forward
bit for bit); sampling is reproducible from a seed and draws what transformers draws from
the same global seed; the top-k and top-p filters equal transformers' logits warpers; bad
arguments get errors that say what to change."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT, TINY, TOL, hf_model, random_batch

from bert_port import BertConfig, BertLMHeadModel, BertModel, KVCache
from bert_port.generation import as_prompts, next_tokens, top_k_filter, top_p_filter

pytestmark = pytest.mark.usefixtures("single_thread")

DECODER = dict(TINY, is_decoder=True)


@pytest.fixture(scope="module")
def pair():
    """transformers' BertLMHeadModel (random, every parameter perturbed so no bias is zero)
    and ours with its weights, loaded by the production loader; both sdpa."""
    import transformers

    transformers.logging.set_verbosity_error()
    hf = hf_model(DECODER, "BertLMHeadModel", attn="sdpa")
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    ours = BertLMHeadModel(BertConfig.from_dict(DECODER))
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours.eval()


def _prompts(kind: str) -> dict:
    g = torch.Generator().manual_seed(3)
    if kind == "one":
        return {"input_ids": torch.randint(1, 99, (1, 5), generator=g)}
    if kind == "batch":
        return {"input_ids": torch.randint(1, 99, (3, 6), generator=g)}
    batch = random_batch(99, B=3, T=7, pad="left", seed=3)  # row i has i pads on the left
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("kind", ["one", "batch", "left-padded"])
def test_greedy_equals_transformers_token_for_token(pair, kind, use_cache):
    hf, ours = pair
    prompts = _prompts(kind)
    expected = hf.generate(**prompts, max_new_tokens=12, do_sample=False)
    actual = ours.generate(**prompts, max_new_tokens=12, use_cache=use_cache)
    assert torch.equal(actual, expected)
    assert actual.shape == (prompts["input_ids"].shape[0], prompts["input_ids"].shape[1] + 12)


def test_greedy_in_exact_mode_equals_transformers_eager(pair):
    hf, ours = pair
    ours.config.attn_implementation = EXACT["attn_implementation"]
    hf.set_attn_implementation("eager")
    try:
        prompts = _prompts("left-padded")
        expected = hf.generate(**prompts, max_new_tokens=10, do_sample=False)
        assert torch.equal(ours.generate(**prompts, max_new_tokens=10), expected)
    finally:
        ours.config.attn_implementation = "sdpa"
        hf.set_attn_implementation("sdpa")


def test_left_padded_rows_generate_what_they_generate_alone(pair):
    _, ours = pair
    prompts = _prompts("left-padded")
    together = ours.generate(**prompts, max_new_tokens=8)
    for i, row in enumerate(prompts["attention_mask"].bool()):
        alone = ours.generate(prompts["input_ids"][i : i + 1, row], max_new_tokens=8)
        assert torch.equal(together[i, -8:], alone[0, -8:])


@pytest.mark.parametrize("pad", ["none", "left"])
def test_cached_steps_equal_recomputing_the_prefix(pair, pad):
    """A prompt run on the cache in pieces (4 tokens, 2 tokens, then one at a time) gives at
    every position the logits of the whole sequence run at once: positions continue from
    the cached length (or, left-padded, from each row's first real token)."""
    _, ours = pair
    batch = random_batch(99, B=3, T=9, pad="left", seed=5)
    ids, mask = batch["input_ids"], batch["attention_mask"] if pad == "left" else None
    positions = None if mask is None else (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        full = ours(ids, mask, position_ids=positions).logits  # (B, T, V)
        cache, pieces = KVCache(TINY["num_hidden_layers"]), []
        for start, stop in ((0, 4), (4, 6), (6, 7), (7, 8), (8, 9)):
            out = ours(
                ids[:, start:stop],
                None if mask is None else mask[:, :stop],
                position_ids=None if positions is None else positions[:, start:stop],
                cache=cache,
            )
            assert out.cache is cache and cache.get_seq_length() == stop
            pieces.append(out.logits)
    cached = torch.cat(pieces, dim=1)
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(cached[real], full[real], **TOL[torch.float32])


def test_cached_forward_in_exact_mode_is_transformers_cached_forward_bitwise():
    """Both caches concatenate into contiguous keys and values, so the eager maths and layout
    are the same: prefill and each step give transformers' logits bit for bit."""
    from transformers import DynamicCache

    hf = hf_model(DECODER, "BertLMHeadModel")
    ours = BertLMHeadModel(BertConfig.from_dict(DECODER, **EXACT))
    ours.load_hf_state_dict(hf.state_dict())
    ours.eval()
    batch = random_batch(99, B=3, T=8, pad="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    cache, hf_cache = KVCache(TINY["num_hidden_layers"]), DynamicCache(config=hf.config)
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6), (6, 8)):
            step = dict(attention_mask=mask[:, :stop], position_ids=positions[:, start:stop])
            actual = ours(ids[:, start:stop], **step, cache=cache).logits
            expected = hf(ids[:, start:stop], **step, cache=hf_cache, use_cache=True).logits
            assert torch.equal(actual, expected), (start, stop)


def test_use_cache_on_the_body_returns_a_cache_and_an_encoder_ignores_it():
    decoder = BertModel(BertConfig.from_dict(DECODER)).eval()
    ids = torch.randint(1, 99, (2, 5))
    with torch.no_grad():
        out = decoder(ids, use_cache=True)
        assert isinstance(out.cache, KVCache) and out.cache.get_seq_length() == 5
        assert "cache" not in decoder(ids)  # nothing cached unless asked for
        assert "cache" not in BertModel(BertConfig.from_dict(TINY)).eval()(ids, use_cache=True)


def test_sampling_is_reproducible_from_a_seed(pair):
    _, ours = pair
    prompts = _prompts("batch")
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=1.5)
    first = ours.generate(**prompts, **kwargs, seed=11)
    assert torch.equal(ours.generate(**prompts, **kwargs, seed=11), first)
    assert torch.equal(ours.generate(**prompts, **kwargs, generator=torch.Generator().manual_seed(11)), first)
    # 60 draws from nearly flat distributions over 99 tokens: another seed repeating all of
    # them has a probability far below 1e-50.
    assert not torch.equal(ours.generate(**prompts, **kwargs, seed=12), first)
    assert not torch.equal(first[:, -20:], ours.generate(**prompts, max_new_tokens=20)[:, -20:])  # not greedy


@pytest.mark.parametrize("filters", [dict(top_k=5), dict(top_p=0.8), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_sampling_draws_what_transformers_draws_from_the_same_seed(pair, filters):
    """Same filters, same probabilities (within fp32 rounding), the same `torch.multinomial`
    on the global RNG: the same tokens."""
    hf, ours = pair
    prompts = _prompts("left-padded")
    torch.manual_seed(21)
    expected = hf.generate(**prompts, max_new_tokens=10, do_sample=True, **{"top_k": 0, **filters})
    torch.manual_seed(21)
    assert torch.equal(ours.generate(**prompts, max_new_tokens=10, do_sample=True, **filters), expected)


def test_filters_equal_transformers_logits_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 99, generator=g) * 3
    scores[1, :10] = scores[1, 10]  # ties at the threshold
    for k in (1, 5, 50, 99, 500):
        assert torch.equal(top_k_filter(scores, k), TopKLogitsWarper(k)(None, scores))
    for p in (0.01, 0.3, 0.8, 0.95, 1.0):
        assert torch.equal(top_p_filter(scores, p), TopPLogitsWarper(p)(None, scores))
    greedy = next_tokens(scores)
    assert torch.equal(greedy, scores.argmax(-1))
    # top_k=1 leaves only the argmax to draw.
    assert torch.equal(next_tokens(scores, do_sample=True, top_k=1, generator=g), greedy)


def test_eos_finishes_a_row_and_pads_it_as_transformers(pair):
    hf, ours = pair
    prompts = _prompts("batch")
    greedy = ours.generate(**prompts, max_new_tokens=12)
    eos = int(greedy[0, prompts["input_ids"].shape[1] + 2])  # row 0 emits it at its third step
    expected = hf.generate(**prompts, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=7)
    actual = ours.generate(**prompts, max_new_tokens=12, eos_token_id=eos, pad_token_id=7)
    assert torch.equal(actual, expected)
    row = actual[0, prompts["input_ids"].shape[1] :].tolist()
    assert row[2] == eos and set(row[3:]) <= {7}


def test_the_bundled_checkpoint_as_a_decoder_generates(minilm_path):
    """all-MiniLM-L6-v2 is an encoder without an LM head: loaded with is_decoder=True the head
    is new (and tied), the body causal, and generation continues real text."""
    from bert_port import encode, load_tokenizer

    model = BertLMHeadModel.from_pretrained(minilm_path, is_decoder=True)
    assert "cls.predictions.transform.dense.weight" in model.loading_info["newly_initialized"]
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    batch = encode(load_tokenizer(minilm_path), ["the film is", "a gripping, beautifully shot"])
    prompts = as_prompts(batch)  # left-padded, without [SEP]: continue the text
    n = batch["attention_mask"].sum(1) - 1
    assert prompts["attention_mask"].sum(1).tolist() == n.tolist() and prompts["attention_mask"][1].all()
    assert torch.equal(prompts["input_ids"][0, -int(n[0]) :], batch["input_ids"][0, : int(n[0])])
    out = model.generate(**prompts, max_new_tokens=4)
    assert out.shape == (2, prompts["input_ids"].shape[1] + 4)
    assert torch.equal(out, model.generate(**prompts, max_new_tokens=4, use_cache=False))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer of at least 1, got 0"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer of at least 1"),
        (dict(max_new_tokens=60), r"a prompt of 5 tokens plus max_new_tokens=60 exceeds max_position_embeddings=64"),
        (dict(do_sample=True, temperature=0.0), "temperature must be a number above 0"),
        (dict(do_sample=True, top_k=-1), "top_k must be a positive integer"),
        (dict(do_sample=True, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(do_sample=True, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(do_sample=True, seed=1, generator=torch.Generator()), "pass generator or seed, not both"),
    ],
)
def test_bad_generate_arguments_say_what_to_change(pair, kwargs, message):
    _, ours = pair
    with pytest.raises(ValueError, match=message):
        ours.generate(torch.randint(1, 99, (1, 5)), **kwargs)


def test_generate_and_a_cache_need_a_decoder():
    encoder_lm = BertLMHeadModel(BertConfig.from_dict(TINY))
    with pytest.raises(ValueError, match="is_decoder=False.*is_decoder=True"):
        encoder_lm.generate(torch.randint(1, 99, (1, 5)), max_new_tokens=2)
    with pytest.raises(ValueError, match="KV cache needs causal self-attention.*set is_decoder=True"):
        encoder_lm(torch.randint(1, 99, (1, 5)), cache=KVCache(2))


def test_bad_cache_inputs_say_what_is_wrong(pair):
    _, ours = pair
    ids = torch.randint(1, 99, (1, 5))
    with pytest.raises(ValueError, match="the KV cache has 3 layers, the model 2"):
        ours(ids, cache=KVCache(3))
    cache = KVCache(2)
    with torch.no_grad():
        ours(ids, cache=cache)
    with pytest.raises(ValueError, match=r"\(5 cached positions \+ 1 new\): expected \(1, 6\)"):
        ours(ids[:, :1], attention_mask=torch.ones(1, 1), cache=cache)
    with pytest.raises(ValueError, match="sequence length 60 after 5 cached positions exceeds"):
        ours(torch.randint(1, 99, (1, 60)), cache=cache)


def test_no_cache_is_filled_under_gradient_checkpointing_in_training():
    """A recomputed layer would append its keys twice: an explicit cache is refused there, and
    use_cache=True gives none, as transformers turns it off."""
    model = BertLMHeadModel(BertConfig.from_dict(DECODER))
    model.gradient_checkpointing_enable()
    ids = torch.randint(1, 99, (1, 5))
    with pytest.raises(ValueError, match="cannot be filled under gradient checkpointing in training"):
        model.train()(ids, cache=KVCache(2))
    assert model(ids, use_cache=True).cache is None
    assert model.eval()(ids, use_cache=True).cache.get_seq_length() == 5


def test_pre_ln_decoder_generates_as_megatron_bert(tmp_path):
    """A pre-LN config (`pre_norm`) makes BertLMHeadModel transformers' MegatronBertForCausalLM:
    saved, it loads there with nothing missing, and greedy tokens are Megatron-BERT's."""
    import transformers

    torch.manual_seed(0)
    ours = BertLMHeadModel(BertConfig.from_dict(dict(DECODER, pre_norm=True))).eval()
    with torch.no_grad():
        for param in ours.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    ours.save_pretrained(tmp_path)
    ref, info = transformers.MegatronBertForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    prompts = _prompts("left-padded")
    expected = ref.eval().generate(**prompts, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours.generate(**prompts, max_new_tokens=10), expected)
    assert torch.equal(ours.generate(**prompts, max_new_tokens=10, use_cache=False), expected)


def test_right_padding_warns_and_left_padding_does_not(pair, caplog):
    """`encode`'s right-padded layout: the rows continue differently from each alone, so it is
    warned about (as transformers warns); the same prompts left-padded are not."""
    _, ours = pair
    right = random_batch(99, B=3, T=7, pad="right", seed=3)
    ours.generate(right["input_ids"], right["attention_mask"], max_new_tokens=2)
    assert "right padding in the prompts" in caplog.text
    caplog.clear()
    ours.generate(**as_prompts(right, drop_sep=False), max_new_tokens=2)
    assert "right padding" not in caplog.text


def test_a_fully_padded_row_is_refused(pair):
    _, ours = pair
    batch = random_batch(99, B=3, T=7, pad="left", seed=3)
    batch["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] of the batch are all padding"):
        ours.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=2)


@pytest.mark.parametrize(
    ("length", "new", "advice"),
    [(5, 60, "at most 4 tokens"), (5, 900, "ask for at most 59 new tokens"), (64, 1, "at most 63 tokens")],
)
def test_over_length_message_gives_numbers_that_exist(pair, length, new, advice):
    """The old message said "at most -896 tokens" when max_new_tokens alone was too many."""
    _, ours = pair
    with pytest.raises(ValueError, match=advice) as error:
        ours.generate(torch.randint(1, 99, (1, length)), max_new_tokens=new)
    assert "-" not in str(error.value).split(":", 1)[1]


def test_temperature_0_with_greedy_follows_transformers(pair, caplog):
    """Greedy ignores temperature: transformers warns and decodes greedily, and so do we."""
    hf, ours = pair
    prompts = _prompts("batch")
    expected = hf.generate(**prompts, max_new_tokens=6, do_sample=False, temperature=0.0)
    assert torch.equal(ours.generate(**prompts, max_new_tokens=6, temperature=0.0), expected)
    assert "temperature only apply to sampling" in caplog.text
