"""How many token ids a built model can embed, read from the model itself.

Checks that compare a data source's vocabulary with the model's (token shards, a
tokenizer) read it here, so they work for every model kind: the reference transformer, an
``hf_causal_lm`` model and a user's model alike.
"""

from __future__ import annotations

from torch import nn

__all__ = ["model_vocab_size"]


def _positive_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def model_vocab_size(model: nn.Module) -> int | None:
    """The number of token ids ``model`` embeds, or ``None`` when it does not say.

    In order: the rows of ``model.get_input_embeddings()`` (``transformers`` models and
    ``HFCausalLM``), an integer ``model.vocab_size``, an integer ``model.config.vocab_size``
    (the reference transformer's ``GPTConfig``). Reads shapes only, so a model built on the
    ``meta`` device answers too.
    """
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        embedding = getter()
        if isinstance(embedding, nn.Embedding):
            return embedding.num_embeddings
    direct = _positive_int(getattr(model, "vocab_size", None))
    if direct is not None:
        return direct
    return _positive_int(getattr(getattr(model, "config", None), "vocab_size", None))
