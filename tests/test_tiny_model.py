"""The random glm5_next builder: determinism, fingerprint, tokenizer, template, loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from apcctl.lab.tinymodel.build import STAMP_FILE, build_model
from apcctl.lab.tinymodel.config import cache_bytes, make_config
from apcctl.lab.tinymodel.fingerprint import weights_fingerprint
from apcctl.lab.tinymodel.presets import PRESETS
from apcctl.lab.tinymodel.template import CHAT_TEMPLATE
from apcctl.lab.tinymodel.vocab import (
    CONTROL_TOKENS,
    EOS_TOKENS,
    MARKUP_TOKENS,
    UNK_TOKEN,
    generatable,
    vocabulary,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=0)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_builds_byte_identical_files(tiny: Path, tmp_path: Path) -> None:
    again = build_model(tmp_path / "again", "tiny", seed=0)
    assert _files(again) == _files(tiny)
    assert weights_fingerprint(again) == weights_fingerprint(tiny)


def test_other_seed_changes_weights_and_fingerprint_but_not_config(tiny: Path, tmp_path: Path) -> None:
    other = build_model(tmp_path / "seed1", "tiny", seed=1)
    assert (other / "config.json").read_bytes() == (tiny / "config.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert weights_fingerprint(other) != weights_fingerprint(tiny)


def test_fingerprint_follows_weight_bytes(tiny: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in _files(tiny).items():
        (copy / name).write_bytes(data)
    assert weights_fingerprint(copy) == weights_fingerprint(tiny)
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert weights_fingerprint(copy) != weights_fingerprint(tiny)


def test_matching_stamp_skips_rebuild_and_other_seed_replaces(tmp_path: Path) -> None:
    out = tmp_path / "m"
    build_model(out, "tiny", seed=0)
    before = (out / "model.safetensors").stat().st_mtime_ns
    first = weights_fingerprint(out)
    build_model(out, "tiny", seed=0)
    assert (out / "model.safetensors").stat().st_mtime_ns == before

    build_model(out, "tiny", seed=1)
    assert weights_fingerprint(out) != first
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 1


def test_refuses_to_overwrite_a_directory_it_did_not_build(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_model(foreign, "tiny", seed=0)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError):
        build_model(tmp_path / "x", "huge", seed=0)


def test_tiny_config_has_full_and_shared_indexers_and_real_topk(tiny: Path) -> None:
    text = json.loads((tiny / "config.json").read_text())["text_config"]
    kinds = list(zip(text["layer_types"], text["indexer_types"]))
    assert kinds.count(("deepseek_sparse_attention", "full")) >= 1
    assert kinds.count(("deepseek_sparse_attention", "shared")) >= 1
    assert text["layer_types"].count("linear_attention") >= 2
    # A shared layer needs a full one before it, or the model raises at the first forward.
    first_full = kinds.index(("deepseek_sparse_attention", "full"))
    first_shared = kinds.index(("deepseek_sparse_attention", "shared"))
    assert first_full < first_shared
    assert (text["index_topk"], text["index_kpool"], text["hidden_size"]) == (64, 16, 64)
    assert "sparse" in text["mlp_layer_types"]


def test_bench_preset_latent_and_index_at_16k_is_over_500_mb() -> None:
    ids = {t: i for i, t in enumerate(CONTROL_TOKENS + MARKUP_TOKENS)}
    config = make_config(PRESETS["bench"], ids, vocab_size=4096)
    at_16k = cache_bytes(config, 16384)
    assert at_16k.latent_and_index >= 500_000_000
    assert at_16k.latent_and_index // 16384 == 32786  # the figure the module docstring states


def test_tokenizer_spells_unknown_words_and_keeps_markup(tiny: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    # Whitespace is dropped, punctuation and digits are one token each, decoding joins with spaces.
    ids = tok.encode("hello  world!\n def f(x): 42").ids
    assert tok.decode(ids) == "hello world ! def f ( x ) : 4 2"
    assert len(ids) == 11 and ids[0] == tok.token_to_id("hello")
    # A word outside the list is spelled from characters; one with an unknown character is [UNK].
    spelled = tok.encode("wörld").ids
    assert len(spelled) == 5 and tok.decode(spelled) == "wörld"
    assert tok.encode("🙂").ids == [tok.token_to_id(UNK_TOKEN)]
    for token in CONTROL_TOKENS + MARKUP_TOKENS:
        assert tok.encode(token).ids == [tok.token_to_id(token)]
    # Control tokens vanish when decoding for the user; parser markup must survive.
    marked = tok.encode("<|assistant|><tool_call>f<arg_key>a</arg_key>").ids
    assert tok.decode(marked, skip_special_tokens=True) == "<tool_call> f <arg_key> a </arg_key>"


def test_every_sequence_of_generatable_ids_survives_decode_and_re_encode(tiny: Path) -> None:
    """A client re-sends the reply as text: what the model sampled must come back as the same ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    vocab = vocabulary()
    assert tok.get_vocab_size() == len(vocab) and all(tok.token_to_id(t) == i for i, t in enumerate(vocab))
    allowed = [i for i, t in enumerate(vocab) if generatable(t) and t not in EOS_TOKENS]
    assert len(allowed) > 500
    rng = np.random.RandomState(0)
    for _ in range(20):
        ids = rng.choice(allowed, size=200).tolist()
        assert tok.encode(tok.decode(ids)).ids == ids
    # A word continuation is what must not be sampled: it glues onto the word before it.
    glued = [tok.token_to_id("t"), tok.token_to_id("##o")]  # "to", a word of its own
    assert tok.encode(tok.decode(glued)).ids != glued


def test_the_model_never_samples_control_markup_or_continuation_tokens(loaded, tiny: Path) -> None:
    import mlx.core as mx

    model, _ = loaded
    vocab = vocabulary()
    allowed = np.array([generatable(t) for t in vocab])
    rng = np.random.RandomState(1)
    # Inputs with every kind of token, control and markup included, at every position.
    ids = mx.array([rng.randint(0, len(vocab), 400).tolist()])
    logits = np.array(model.language_model(ids).logits[0])
    assert logits.shape[-1] == len(vocab)
    assert (logits[:, ~allowed].max(axis=1) < logits[:, allowed].min(axis=1) - 100).all()
    # Allowed logits are the random model's: they still vary with the input.
    assert np.unique(logits[:, allowed].argmax(axis=1)).size > 20


def test_eos_ids_are_endoftext_user_observation(tiny: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    config = json.loads((tiny / "config.json").read_text())
    names = [tok.id_to_token(i) for i in config["eos_token_id"]]
    assert names == ["<|endoftext|>", "<|user|>", "<|observation|>"]
    assert config["text_config"]["vocab_size"] == tok.get_vocab_size()


@pytest.fixture(scope="module")
def loaded(tiny: Path):
    from mlx_vlm import load

    return load(str(tiny))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_chat_template_renders_glm45_turns_tools_and_tool_results(loaded) -> None:
    _, processor = loaded
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
        {"role": "assistant", "content": "<think>Easy.</think>\nSunny, 22C.\n"},
        {"role": "user", "content": "Thanks"},
    ]
    text = processor.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text.startswith("[gMASK]<sop><|system|>\n# Tools")
    assert '"name": "get_weather"' in text
    # GLM puts the tools block before the system text.
    assert text.index("</tools>") < text.index("<|system|>\nYou are terse.")
    assert (
        "<|user|>Weather in Paris?<|assistant|>\n<think></think>"
        "\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    ) in text
    assert ("<|observation|>\n<tool_response>\nsunny\n</tool_response>"
            "\n<tool_response>\n22C\n</tool_response>") in text
    assert text.count("<|observation|>") == 1
    # Reasoning before the last user turn is dropped, content is stripped.
    assert "<|assistant|>\n<think></think>\nSunny, 22C.<|user|>Thanks" in text
    assert text.endswith("<|user|>Thanks<|assistant|>\n<think></think>")

    thinking = processor.apply_chat_template(
        messages[:2], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert thinking == "[gMASK]<sop><|system|>\nYou are terse.<|user|>Weather in Paris?<|assistant|>"
    # After the last user turn (a tool loop) the reasoning stays.
    loop = messages[:2] + [{"role": "assistant", "content": "", "reasoning_content": " Check. ",
                            "tool_calls": messages[2]["tool_calls"]}, messages[3]]
    looped = processor.apply_chat_template(loop, tokenize=False, add_generation_prompt=True)
    assert "<|assistant|>\n<think>Check.</think>\n<tool_call>get_weather" in looped


def test_a_reply_re_sent_as_content_re_renders_as_the_generated_ids(loaded) -> None:
    """The GLM-4.5 case end to end at the tokenizer: the next prompt starts with prompt + reply ids."""
    from mlx_vlm import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded
    tok = processor.tokenizer
    eos = {tok.convert_tokens_to_ids(t) for t in EOS_TOKENS}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    for turn in range(2):
        prompt = apply_chat_template(processor, model.config, messages)
        assert prompt.endswith("<|assistant|>\n<think></think>")  # the server's default: thinking off
        ids = tok.encode(prompt, add_special_tokens=False)
        chunks = list(stream_generate(model, processor, prompt, max_tokens=24, temperature=0.0))
        generated = [int(c.token) for c in chunks if c.finish_reason is None and int(c.token) not in eos]
        reply = "".join(c.text for c in chunks)
        assert len(generated) >= 8 and reply == tok.decode(generated)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"more {turn}"}]
        following = tok.encode(apply_chat_template(processor, model.config, messages),
                               add_special_tokens=False)
        assert following[:len(ids) + len(generated)] == ids + generated


def test_jinja_file_and_inline_template_agree(tiny: Path) -> None:
    inline = json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"]
    assert (tiny / "chat_template.jinja").read_text() == inline == CHAT_TEMPLATE



# sha256 of what builder version 2 derives from data/ (measured before the data left the code).
# A change here changes every built model: bump BUILDER_VERSION with it, then update these.
DATA_DIGESTS = {
    "chat_template": "e3576840a978c72d15c150e7bc03da0f1c1975447b9bcc50de805f47e45838a0",
    "vocabulary": "6b30abede1bcd04e34ad1bec788ee0a6776b4b5d90cd542f3be61e341e53d6a7",
    "training_corpus": "c2ba46a1cfd9333fe6f0950319f8bd0e72c271f86917468ebdb18817aa1161f5",
}


def test_data_files_give_builder_version_2_template_vocabulary_and_corpus() -> None:
    import hashlib

    from apcctl.lab.tinymodel.build import BUILDER_VERSION
    from apcctl.lab.tinymodel.corpus import training_corpus

    derived = {"chat_template": CHAT_TEMPLATE, "vocabulary": json.dumps(vocabulary()),
               "training_corpus": json.dumps(training_corpus())}
    digests = {name: hashlib.sha256(text.encode()).hexdigest() for name, text in derived.items()}
    # Versions 3 and 4 changed the weights only (the dominant path, issue 39): the digests stand.
    assert (BUILDER_VERSION, digests) == ("4", DATA_DIGESTS)


# weights_fingerprint of builder 2's seed-0 builds (243eb9e^, measured 2026-12-05): the models every
# test but the speculative ones serves, so their warm == cold comparisons keep builder 2's
# context-driven model. Builder 3 had put the dominant path in these too.
BUILDER_2_FINGERPRINTS = {
    "tiny": "623b1f81e7bc3af8fcf8d6b1a8d9bc9a2cc105682c5074f964a1d3a37f806cda",
    "bench": "392fd199d195149dccfc02ec24774debd8b48ae973fe72d2a7d16424438a36dc",
}


@pytest.mark.parametrize("preset", sorted(BUILDER_2_FINGERPRINTS))
def test_tiny_and_bench_weigh_exactly_as_builder_2s(preset: str, tmp_path: Path) -> None:
    assert PRESETS[preset].path_gain == 0.0
    assert weights_fingerprint(build_model(tmp_path / preset, preset, seed=0)) == BUILDER_2_FINGERPRINTS[preset]


def test_the_spec_twin_differs_from_tiny_only_on_the_dominant_path(tiny: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from apcctl.lab.tinymodel.weights import path_features

    spec = build_model(tmp_path / "spec", "tiny-spec", seed=0)
    assert (spec / "config.json").read_bytes() == (tiny / "config.json").read_bytes()
    plain, pathed = (load_file(str(d / "model.safetensors")) for d in (tiny, spec))
    assert plain.keys() == pathed.keys()
    outside = np.ones(PRESETS["tiny"].hidden, dtype=bool)
    outside[path_features(PRESETS["tiny"].hidden)] = False
    embed, head = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"
    for name in (embed, head):
        assert np.array_equal(plain[name][:, outside], pathed[name][:, outside])
        assert not np.array_equal(plain[name][:, ~outside], pathed[name][:, ~outside])
    changed = [n for n in plain if not np.array_equal(plain[n], pathed[n])]
    writers = set(changed) - {embed, head}  # besides those two, residual writers: path rows zeroed
    assert writers and all(n.endswith(("o_proj.weight", "down_proj.weight")) for n in writers)


def test_no_gain_adds_no_path() -> None:
    from apcctl.lab.tinymodel.weights import add_dominant_path, init_weights

    config = make_config(PRESETS["tiny"], {t: i for i, t in enumerate(CONTROL_TOKENS + MARKUP_TOKENS)}, 512)
    weights = init_weights(config, 0)
    before = {name: value.copy() for name, value in weights.items()}
    allowed = np.ones(512, dtype=bool)
    successor = add_dominant_path(weights, allowed, [0], seed=0, gain=0.0)
    assert all(np.array_equal(before[name], weights[name]) for name in before)
    assert successor.shape == (512,)


def test_every_data_file_is_declared_package_data() -> None:
    """An editable install reads data/ from the checkout; a wheel holds only what the globs name."""
    import fnmatch
    import tomllib
    from importlib import resources

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["apcctl.lab.tinymodel"]
    names = [f"data/{f.name}" for f in resources.files("apcctl.lab.tinymodel").joinpath("data").iterdir()]
    assert len(names) >= 5
    assert [n for n in names if not any(fnmatch.fnmatch(n, g) for g in globs)] == []

def test_loads_and_generates_greedily_and_deterministically(loaded) -> None:
    from mlx_vlm import generate
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = loaded
    prompt = apply_chat_template(processor, model.config, [{"role": "user", "content": "Hello there"}])
    first = generate(model, processor, prompt, max_tokens=6, temperature=0.0, verbose=False)
    second = generate(model, processor, prompt, max_tokens=6, temperature=0.0, verbose=False)
    assert first.generation_tokens == 6
    assert first.prompt_tokens > 5
    assert first.text and first.text == second.text


def test_cache_bytes_matches_the_model_caches_after_a_long_prefill(loaded, tiny: Path) -> None:
    import mlx.core as mx
    from mlx_vlm.models.cache import CacheList

    model, _ = loaded
    tokens = 300  # > index_topk, so the indexer really selects
    cache = model.language_model.make_cache()
    ids = mx.array([[(7 * i) % 1000 + 30 for i in range(tokens)]])
    mx.eval(model.language_model(ids, cache=cache).logits)

    def state_bytes(c) -> int:
        return sum(a.nbytes for a in _arrays(c.state))

    latent = index = projected = 0
    for c in cache:
        if not isinstance(c, CacheList):
            continue
        latent += state_bytes(c[0])
        if len(c.caches) == 4:  # own indexer: latent, validity, pools, projected
            index += state_bytes(c[1]) + state_bytes(c[2])
            projected += state_bytes(c[3])
        else:  # shared indexer: latent, projected
            projected += state_bytes(c[1])
    expected = cache_bytes(json.loads((tiny / "config.json").read_text()), tokens)
    assert (latent, index, projected) == (expected.latent, expected.index, expected.projected)


def _arrays(state):
    for item in state:
        if isinstance(item, (list, tuple)):
            yield from _arrays(item)
        elif item is not None:
            yield item


def test_cli_build_and_fingerprint(tmp_path: Path) -> None:
    from apcctl.cli import main

    runner = CliRunner()
    out = tmp_path / "cli-model"
    result = runner.invoke(main, ["model", "build", str(out), "--preset", "tiny", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "latent+index cache 261 B/token" in result.output
    result = runner.invoke(main, ["model", "fingerprint", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["fingerprint"] == weights_fingerprint(out)
    result = runner.invoke(main, ["model", "fingerprint", str(tmp_path)])
    assert result.exit_code != 0 and "no config.json" in result.output
