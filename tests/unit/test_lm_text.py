"""Text for the language models: ``snnfw tokenize`` writes the token folder ``token_memmap`` reads as next-token
windows, bits per byte follow the folder's bytes a token, and ``snnfw generate`` samples a trained tiny run, one
process, seeded; what a user can get wrong is refused in one line."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import snnfw
from snnfw.cli import main
from snnfw.config import build_config
from snnfw.data.text import TokenMeta
from snnfw.plan.prepare import build_datasets, build_model
from snnfw.plugin.manager import Plugins
from snnfw.tools import generate
from snnfw.tools.tokenize import tokenize

LENGTH = 16
TEXT = "def add(x, y):\n    return x + y\n\n" * 40
DOCUMENTS = ["première ligne", "second document\n"]


def lm_config(data: dict, steps: int = 2) -> dict:
    return {"model": {"family": "spiking_lm", "flavor": "tiny", "time_steps": 2},
            "data": {"batch_size": 4, "train_samples": 16, "test_samples": 4, **data},
            "train": {"steps": steps, "seed": 1}}


@pytest.fixture(scope="module")
def plugins():
    return Plugins()


def sources(folder: Path) -> list[str]:
    (folder / "code.txt").write_text(TEXT)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    return [str(folder / "code.txt"), str(folder / "docs.jsonl")]


def all_ids(folder: Path, dtype: str) -> np.ndarray:
    return np.concatenate([np.fromfile(TokenMeta.split_path(folder, split), dtype=dtype)
                           for split in ("train", "test")])


def test_tokenize_writes_the_bytes_of_every_document_and_holds_out_the_last_share(tmp_path):
    line = tokenize(sources(tmp_path), tmp_path / "tok", val_share=0.05)
    meta = TokenMeta.read(tmp_path / "tok")
    text = (TEXT + "première ligne\nsecond document\n").encode()
    assert all_ids(tmp_path / "tok", "uint16").tolist() == list(text)
    assert meta.dtype == "uint16" and meta.vocab_size == 256 and meta.bytes_per_token == 1.0
    assert meta.tokens == {"train": len(text) - math.ceil(0.05 * len(text)), "val": math.ceil(0.05 * len(text))}
    assert f"{len(text):,} tokens" in line


def test_token_memmap_windows_are_the_next_tokens_of_the_files(tmp_path, plugins):
    tokenize(sources(tmp_path), tmp_path / "tok", val_share=0.2)
    config = build_config(lm_config({"name": "token_memmap", "root": str(tmp_path / "tok")}))
    train, test = build_datasets(config, build_model(config, plugins)[1], plugins)
    ids = torch.from_numpy(np.fromfile(tmp_path / "tok" / "train.bin", dtype="uint16").astype("int64"))
    assert len(train) == 16 and len(test) == 4
    for index in (0, 7, 15):
        inputs, targets = train[index]
        start = int(train.starts[index])
        assert inputs.shape == (2, LENGTH) and torch.equal(inputs[1], ids[start : start + LENGTH])
        assert torch.equal(targets, ids[start + 1 : start + LENGTH + 1])
    assert train.starts[-1] + LENGTH + 1 <= len(ids)  # spread over the whole split


def run_lm(run_dir: Path, data: dict) -> dict:
    """A tiny spiking_lm trained two steps into ``run_dir``, its final model exported; its validation."""
    with snnfw.start(build_config(lm_config(data)), run_dir=run_dir) as run:
        for step in range(2):
            run.step(step)
        scores = run.evaluate()
        run.export(run_dir / "final_model.pt")
    return scores


@pytest.fixture(scope="module")
def bytes_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bytes_run")
    run_lm(run_dir, {"name": "python_bytes"})
    return run_dir


def test_generate_samples_the_tokens_asked_for_the_same_for_a_seed(bytes_run):
    model, spec, tokenizer = generate.load(bytes_run)
    prompt = tokenizer.encode("def main(")
    first = generate.sample(model, spec, prompt, 20, seed=5)
    assert len(first) == 20 and all(0 <= i < 256 for i in first)
    assert generate.sample(model, spec, prompt, 20, seed=5) == first
    assert generate.sample(model, spec, prompt, 20, seed=6) != first
    greedy = generate.sample(model, spec, prompt * 3, 3, temperature=0)  # a prompt longer than S: cropped
    assert greedy == generate.sample(model, spec, prompt * 3, 3, temperature=0, top_k=1, seed=9)
    assert generate.generate(bytes_run, "def main(", 20, seed=5) == "def main(" + tokenizer.decode(first)


@pytest.mark.parametrize("argv, says", [
    (["generate", "{run}", "--prompt", ""], "--prompt is empty"),
    (["generate", "{tmp}/nowhere", "--prompt", "x"], "does not exist; name a run directory"),
    (["generate", "{tmp}", "--prompt", "x"], "holds no final_model.pt"),
    (["generate", "{run}", "--prompt", "x", "--tokens", "0"], "--tokens counts the tokens"),
    (["tokenize", "{tmp}/missing.txt", "--out", "{tmp}/t"], "no such file"),
    (["tokenize", "{tmp}/bad.jsonl", "--out", "{tmp}/t"], "line 2 is not a JSON object with a \"text\" field"),
    (["tokenize", "{tmp}/bad.jsonl", "--out", "{tmp}/t", "--tokenizer", "bpe:100"], "V an integer above 256"),
    (["tokenize", "{tmp}/bad.jsonl", "--out", "{tmp}/t", "--val-share", "1"], "--val-share"),
])
def test_what_a_user_gets_wrong_is_refused_in_one_line(bytes_run, tmp_path, capsys, argv, says):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "no"}\n')
    assert main([arg.format(run=bytes_run, tmp=tmp_path) for arg in argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_bpe_without_the_tokenizers_package_is_refused_with_the_install_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers raises ImportError
    (tmp_path / "code.txt").write_text(TEXT)
    for tokenizer in ("bpe:300", str(tmp_path / "tokenizer.json")):
        assert main(["tokenize", str(tmp_path / "code.txt"), "--out", str(tmp_path / "t"), "--tokenizer", tokenizer]) == 2
        err = capsys.readouterr().err
        assert "needs the tokenizers package, which is not installed; pip install 'snnfw[lm]'" in err, err
        assert err.count("\n") == 1


def test_a_folder_without_meta_and_a_vocabulary_larger_than_the_models_are_refused(tmp_path, plugins):
    config = build_config(lm_config({"name": "token_memmap", "root": str(tmp_path)}))
    spec = build_model(config, plugins)[1]
    with pytest.raises(snnfw.api.DataError, match="holds no readable meta.json; build the folder with snnfw tokenize"):
        build_datasets(config, spec, plugins)
    TokenMeta("uint16", 300, 2.5, "tokenizer.json", {}).write(tmp_path)
    with pytest.raises(snnfw.api.ConfigError, match="vocabulary of 300, more than the model's 256"):
        build_datasets(config, spec, plugins)


needs_tokenizers = pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                      reason="BPE and tokenizer.json folders need the tokenizers package (snnfw[lm])")


@needs_tokenizers
def test_bpe_ids_decode_to_the_documents(tmp_path):
    tokenize(sources(tmp_path), tmp_path / "tok", "bpe:300")
    meta = TokenMeta.read(tmp_path / "tok")
    ids = all_ids(tmp_path / "tok", meta.dtype).tolist()
    text = TEXT + "première ligne\nsecond document\n"
    assert meta.tokenizer == "tokenizer.json" and 256 < meta.vocab_size <= 300
    assert meta.load_tokenizer(tmp_path / "tok").decode(ids) == text
    assert meta.bytes_per_token == pytest.approx(len(text.encode()) / len(ids)) and meta.bytes_per_token > 2


def word_tokenizer(path: Path) -> None:
    """A saved tokenizers word-level tokenizer of the words of TEXT: fewer ids than bytes, several bytes each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    split = pre_tokenizers.Split(" ", "merged_with_previous")
    words = sorted({word for word, _ in split.pre_tokenize_str(TEXT)} | {"[UNK]"})
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = split
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path))


@needs_tokenizers
def test_bits_per_byte_and_generate_follow_a_tokenizer_json_folder(tmp_path):
    word_tokenizer(tmp_path / "words.json")
    (tmp_path / "code.txt").write_text(TEXT)
    tokenize([str(tmp_path / "code.txt")], tmp_path / "tok", str(tmp_path / "words.json"), val_share=0.3)
    meta = TokenMeta.read(tmp_path / "tok")
    assert meta.vocab_size < 20 and meta.bytes_per_token > 2
    scores = run_lm(tmp_path / "run", {"name": "token_memmap", "root": str(tmp_path / "tok")})
    assert scores["eval_bpb"] == pytest.approx(scores["eval_loss"] / math.log(2) / meta.bytes_per_token)
    model, spec, tokenizer = generate.load(tmp_path / "run")
    prompt = tokenizer.encode("def add(x, ")
    assert len(prompt) == 2 and tokenizer.decode(prompt) == "def add(x, "
    sampled = generate.sample(model, spec, prompt, 6, seed=2)
    assert len(sampled) == 6 and generate.generate(tmp_path / "run", "def add(x, ", 6, seed=2) == \
        "def add(x, " + tokenizer.decode(sampled)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, --gpu runs the layouts")
def test_the_gpu_benchmark_without_cuda_prints_each_layout_s_command_and_exits_0(capsys):
    path = Path(__file__).parents[2] / "benchmark" / "spiking_lm.py"
    module_spec = importlib.util.spec_from_file_location("spiking_lm_benchmark", path)
    benchmark = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(benchmark)
    assert benchmark.main(["--gpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("    python -m snnfw bench ") == len(benchmark.GPU_RUNS) == 5
    assert "--nproc 4" in out and "'parallel.mesh={pp = 4}'" in out and "published: 1379.9 tokens/s" in out
    assert "nothing was run" in out
