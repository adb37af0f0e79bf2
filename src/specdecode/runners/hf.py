"""Any transformers causal LM as a ModelRunner, on a DynamicCache.

Rollback. Attention layers crop their keys and values; sliding-window and short-convolution
layers (LFM2) record their past until a crop (`activate_past_recording`) and crop exactly too.
A recurrent state (Mamba's selective scan) is advanced in place by every token and cannot be
taken back: such a cache does not roll back (`rolls_back`), the decoder runs its model
target-only, and a crop into it empties it. transformers knows which only once a layer has
run, so the runner asks it after a forward of two tokens on a scratch cache.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import DynamicCache, PreTrainedModel, cache_utils

from specdecode.loading import give_freed_memory_back, quantization_of
from specdecode.runners.rowwise import make_rows_exact, verifying

# transformers' linear-attention cache layers (and hybrids): convolution and recurrent states
_LINEAR_LAYERS = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
# transformers 5.25 records recurrent states for rollback unless told 0; 5.24 takes no such argument
_NO_RECURRENT_HISTORY = (
    {"recurrent_states_to_keep": 0}
    if _LINEAR_LAYERS
    and "recurrent_states_to_keep" in inspect.signature(_LINEAR_LAYERS.activate_past_recording).parameters
    else {}
)


class HFModelRunner:
    """A transformers causal LM with a DynamicCache, one sequence at a time."""

    stacks_sequences = False
    batch_invariant = False  # transformers' kernels round a row by what shares its product
    reuses_prefixes = False  # and a prompt's rows by how many run with them
    compilable = False
    verifies_trees = False  # its attention takes no tree mask whose rows keep their one-token bits
    # layer i: the hidden state entering decoder layer i; L (the number of layers): the last
    # layer's output before the final norm. Set: every forward keeps them for its new rows in
    # `hidden` [n_new, len(hidden_layers), hidden] (a draft head reads them); (): nothing kept
    hidden_layers: tuple[int, ...] = ()
    hidden: torch.Tensor | list[torch.Tensor] | None = None

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        # bitsandbytes rounds its layers' inputs: verified rows must get their one-token bits,
        # or speculation drifts from the quantized model's own output (rowwise.py)
        self._rows_exact = quantization_of(model) is not None
        self._copied = make_rows_exact(model) if self._rows_exact else []
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048))
        self.device, self.dtype = model.device, model.dtype
        self.rolls_back = self._cache_rolls_back()
        self.reset()

    @property
    def cache_length(self) -> int:
        return self._length

    def release_model_weights(self) -> None:
        """Free the original weights of the layers a bitsandbytes model runs on oneDNN's
        products (rowwise.make_rows_exact), which hold a copy; the model still runs. On the CPU
        bitsandbytes repacks each 4-bit layer on its first forward, through temporaries that
        glibc keeps: one forward now, then that memory goes back too."""
        for module in self._copied:
            module.to("meta")
        self._copied = []
        if quantization_of(self.model) in ("nf4", "fp4") and self.device.type == "cpu":
            self.forward(torch.zeros(1, dtype=torch.long), 1)
            self.reset()
        give_freed_memory_back()

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        if self.rolls_back:
            # sliding-window and convolution layers keep their past until a crop, so that a
            # crop can take rejected drafts back (a recurrent cache decodes as generate does)
            _record_past(self._cache)
        self._length = 0

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_logits: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        if parents is not None:
            raise ValueError("HFModelRunner does not verify trees (verifies_trees is False): pass parents=None")
        count = token_ids.shape[0]
        if not self.rolls_back and self._length > 0 and count > 1:
            # after a cached prefix a recurrent layer goes on one token at a time (transformers'
            # Mamba starts a longer chunk's scan from a zero state), as generate runs it
            rows, hidden = [], []
            for i in range(count):
                rows.append(self.forward(token_ids[i : i + 1], 1))
                hidden.append(self.hidden)
            self.hidden = torch.cat(hidden) if self.hidden_layers else None
            return torch.cat(rows[count - num_logits :])
        verification = self._rows_exact and self._length > 0 and count > 1
        saved = self._saved_states()
        self.hidden = None
        try:
            with verifying() if verification else contextlib.nullcontext(), self._recording() as recorded:
                out = self.model(
                    input_ids=token_ids.to(self.device)[None],
                    cache=self._cache,  # updated in place
                    use_cache=True,
                    logits_to_keep=num_logits,
                )
        except BaseException:
            # a forward that fails part-way (out of memory, an interrupt) has advanced the
            # layers that ran and not the others: put them back (cache_length stays the truth)
            self._restore(saved)
            raise
        self._length += count
        if self.hidden_layers:
            self.hidden = torch.stack([recorded[i] for i in self.hidden_layers], dim=1)  # [n, layers, hidden]
        return out.logits[0, -num_logits:].float().cpu()

    @contextlib.contextmanager
    def _recording(self):
        """Hooks that record the hidden states of hidden_layers (the class comment) by layer
        index, from this forward; none when nothing is asked. transformers' own
        output_hidden_states gives its last entry after the final norm, so hooks on the decoder
        layers read the inputs and the last output directly."""
        recorded: dict[int, torch.Tensor] = {}
        if not self.hidden_layers:
            yield recorded
            return
        layers = decoder_layers(self.model)
        hooks = []
        for i in set(self.hidden_layers):
            if not 0 <= i <= len(layers):
                raise ValueError(f"hidden layer {i} out of 0..{len(layers)}: the model has {len(layers)} layers")
            if i < len(layers):
                hooks.append(layers[i].register_forward_pre_hook(_input_recorder(recorded, i), with_kwargs=True))
            else:
                hooks.append(layers[-1].register_forward_hook(_output_recorder(recorded, i)))
        try:
            yield recorded
        finally:
            for hook in hooks:
                hook.remove()

    @torch.inference_mode()  # transformers 5.25 subtracts a crop from a layer's length tensor, made in a forward
    def crop(self, length: int) -> None:
        """Keep the first `length` positions; where they cannot be taken back (a recurrent
        state, or a convolution that recorded less), the cache is emptied: cache_length is then
        0 and the caller runs the tokens again."""
        if length >= self._length:
            return
        if length == 0 or not (self.rolls_back and self._convolutions_recorded(self._length - length)):
            self.reset()  # nothing kept: a new cache is one that never ran
            return
        self._crop_layers(length, self._cache.layers)
        self._length = length

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep the first len(offsets) of the last forward's new tokens (a crop); it runs no
        trees, so other offsets are refused."""
        if list(offsets) != list(range(len(offsets))):
            raise ValueError(f"HFModelRunner keeps a prefix of the new tokens, not offsets {list(offsets)}")
        self.crop(start + len(offsets))

    def _cache_rolls_back(self) -> bool:
        """Whether every layer of this model's cache crops exactly; a linear-attention layer
        tells only once it has run (whether it keeps a recurrent state)."""
        cache = DynamicCache(config=self.model.config)
        linear = [layer for layer in cache.layers if isinstance(layer, _LINEAR_LAYERS)]
        if not linear:
            return getattr(cache, "is_croppable", True)
        _record_past(cache)
        with torch.inference_mode():
            probe = torch.zeros(1, 2, dtype=torch.long, device=self.device)
            self.model(input_ids=probe, cache=cache, use_cache=True, logits_to_keep=1)
        # transformers 5.24 says so in is_croppable; 5.25 says True for every linear layer (it can
        # record recurrent states, which this runner does not ask for): a recurrent state decides
        recurrent = any(any(layer.is_recurrent_states_initialized.values()) for layer in linear)
        return getattr(cache, "is_croppable", True) and not recurrent

    def _saved_states(self) -> list[tuple[object, dict]]:
        """What a failed forward must give back to the linear-attention layers: their attributes.
        Recording their past, transformers replaces their convolution states rather than
        writing them in place, so references keep the old ones (there is no recurrent state
        where the cache rolls back)."""
        if not self.rolls_back or self._length == 0:
            return []  # _restore empties the cache
        return [(layer, _copy_state(vars(layer))) for layer in self._cache.layers if isinstance(layer, _LINEAR_LAYERS)]

    def _restore(self, saved: list[tuple[object, dict]]) -> None:
        """Every layer back to the cached length after a failed forward: linear-attention layers
        given back their saved states, the others cropped by the length each really holds. A
        cache that cannot roll back (a recurrent state the forward may have advanced) is emptied."""
        if not self.rolls_back or self._length == 0:
            self.reset()
            return
        for layer, state in saved:
            vars(layer).clear()
            vars(layer).update(state)
        self._crop_layers(
            self._length, [layer for layer in self._cache.layers if not isinstance(layer, _LINEAR_LAYERS)]
        )

    def _crop_layers(self, length: int, layers: list) -> None:
        """Keep the first `length` positions of these layers, by the length each one really
        holds (after a failed forward they differ); layers that report no length of their own
        (linear attention, transformers' DummyLayer) hold the cached length."""
        for layer in layers:
            held = layer.get_seq_length() if isinstance(layer, cache_utils.CacheLayerMixin) else self._length
            if held > length:
                # transformers 5.x: a negative argument removes that many positions from the end
                layer.crop(length - held)

    def _convolutions_recorded(self, removed: int) -> bool:
        """Whether each convolution layer still holds the positions its next forward reads
        (its kernel's width less one) once `removed` positions are cropped: it records its past
        only since the last crop."""
        for layer in self._cache.layers:
            if not isinstance(layer, _LINEAR_LAYERS):
                continue
            for index, state in layer.conv_states.items():
                if state is None:
                    continue
                needed = min(layer.conv_kernel_size[index] - 1, self._length - removed)
                if state.shape[-1] - removed < needed:
                    return False
        return True


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's stack of decoder layers (Llama family: model.layers; GPT-2: transformer.h)."""
    base = model.base_model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of a {type(model).__name__}")


def _input_recorder(recorded: dict[int, torch.Tensor], index: int):
    def hook(module, args, kwargs):
        value = args[0] if args else kwargs["hidden_states"]  # [1, n, hidden]
        recorded[index] = value[0]

    return hook


def _output_recorder(recorded: dict[int, torch.Tensor], index: int):
    def hook(module, args, output):
        value = output[0] if isinstance(output, tuple) else output  # [1, n, hidden]
        recorded[index] = value[0]

    return hook


def _record_past(cache: DynamicCache) -> None:
    """Convolution and sliding-window layers keep their past until a crop; recurrent states are
    not recorded (this runner never rolls one back)."""
    cache.activate_past_recording(**_NO_RECURRENT_HISTORY)


def _copy_state(attributes: dict) -> dict:
    """A layer's attributes, its dictionaries (of states, by index) copied one level down, and
    its tensors (transformers 5.25 counts a layer's length in one, added to in place) cloned."""
    copied = {}
    for name, value in attributes.items():
        if isinstance(value, dict):
            value = dict(value)
        elif isinstance(value, torch.Tensor):
            value = value.clone()
        copied[name] = value
    return copied
