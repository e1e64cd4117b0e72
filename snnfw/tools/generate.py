"""``snnfw generate``: text sampled from a trained language model run, in one process whatever strategy trained it.

The run's recorded config builds the model (as ``snnfw export --format nir`` builds it) and its weights are loaded:
the run directory's final model or newest checkpoint (:func:`snnfw.components.export.weights_of`), else its
``best_model.pt``, or the weights file named. The prompt is encoded with the tokenizer of the run's data set
(``DatasetSpec.tokenizer``: bytes for ``python_bytes``, the one in ``meta.json`` for ``token_memmap``). Each new
token is one forward pass over the last ``sequence_length`` tokens, each presented for the model's T time steps
from reset neurons; the last position's logits, averaged over T, divided by the temperature and cut to the top k,
are sampled from with a generator seeded by ``seed`` (temperature 0: the likeliest token).
"""

from __future__ import annotations

from pathlib import Path

import torch

from snnfw.errors import CheckpointError, ConfigError


def check_settings(prompt: str, tokens: int, temperature: float, top_k: int | None) -> None:
    if not prompt:
        raise ConfigError("--prompt is empty; give the text to continue")
    if tokens < 1:
        raise ConfigError(f"--tokens counts the tokens to sample, 1 or more; got {tokens}")
    if not temperature >= 0:
        raise ConfigError(f"--temperature divides the logits, 0 (the likeliest token) or more; got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k samples among the K likeliest tokens, K 1 or more; got {top_k}")


def weights_of(run: str | Path) -> Path:
    """The weights of ``run``: as ``snnfw export`` finds them, else a run directory's ``best_model.pt``."""
    from snnfw.components import export
    from snnfw.data.text import META, SPLIT_FILES
    from snnfw.rundir import BEST_MODEL

    if (Path(run) / META).is_file() and (Path(run) / SPLIT_FILES["train"]).is_file():
        raise ConfigError(f"{run} is a token folder (snnfw tokenize wrote it), not a run; name the run directory of a "
                          "model trained on it")
    try:
        return export.weights_of(run)[0]
    except CheckpointError:
        if (Path(run) / BEST_MODEL).is_file():
            return Path(run) / BEST_MODEL
        raise


def load(run: str | Path):
    """The run's model (weights loaded, in evaluation mode), its input spec and its data set's tokenizer."""
    from snnfw.components import export
    from snnfw.components.weights import load_weights, read_weights
    from snnfw.plan.prepare import model_alone
    from snnfw.plugin.manager import Plugins

    weights = weights_of(run)
    config, plugins = export.run_config(weights), Plugins()
    if config.data.builder is not None:
        raise ConfigError(f"the run's data come from data.builder {config.data.builder!r}, which names no tokenizer; "
                          "generate samples runs on a registered text data set (python_bytes, token_memmap)")
    dataset = plugins.datasets.get(config.data.name)
    if dataset.tokenizer is None:
        raise ConfigError(f"data set {config.data.name!r} of the run declares no tokenizer; generate samples language "
                          "models trained on a text data set (python_bytes, token_memmap)")
    config, model, spec = model_alone(config, plugins)
    if spec.vocab is None:
        raise ConfigError(f"the run trained {config.model.family}, which is no language model; generate samples a "
                          "language model run (model.family = \"spiking_lm\")")
    load_weights(model, read_weights(weights))
    return model.to(config.train.torch_dtype).eval(), spec, dataset.tokenizer(config.data)


@torch.no_grad()
def sample(model, spec, prompt_ids: list[int], tokens: int, temperature: float = 1.0, top_k: int | None = None,
           seed: int = 0) -> list[int]:
    """``tokens`` ids sampled after ``prompt_ids``."""
    from spikingjelly.activation_based import functional

    if bad := [i for i in prompt_ids if not 0 <= i < spec.vocab]:
        raise ConfigError(f"the prompt encodes to id {bad[0]}, outside the model's vocabulary of {spec.vocab}; "
                          "train on a vocabulary that holds the tokenizer's")
    generator = torch.Generator().manual_seed(seed)
    ids, length = list(prompt_ids), spec.shape[0]
    for _ in range(tokens):
        context = torch.tensor(ids[-length:]).expand(1, spec.time_steps, -1)  # [N = 1, T, S]
        functional.reset_net(model)
        logits = model(context)[:, 0, -1].mean(0).double()  # the last position's, averaged over T
        if temperature == 0:
            ids.append(int(logits.argmax()))
            continue
        logits = logits / temperature
        if top_k is not None and top_k < logits.numel():
            logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -torch.inf)
        ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=generator)))
    return ids[len(prompt_ids):]


def generate(run: str | Path, prompt: str, tokens: int = 64, temperature: float = 1.0, top_k: int | None = None,
             seed: int = 0) -> str:
    """The prompt followed by the text of ``tokens`` sampled tokens."""
    check_settings(prompt, tokens, temperature, top_k)
    model, spec, tokenizer = load(run)
    return prompt + tokenizer.decode(sample(model, spec, tokenizer.encode(prompt), tokens, temperature, top_k, seed))
