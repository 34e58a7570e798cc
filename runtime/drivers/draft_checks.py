"""Whether a draft export can draft for a target: the same token ids, the same special tokens, one vocabulary
size, a model of its own. Checked once at load, each failure one line naming the difference."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvforge.core.errors import InputError

if TYPE_CHECKING:
    from kvforge.runtime.drivers.loaded_export import LoadedExport


def check_draft_pair(draft: LoadedExport, target: LoadedExport) -> None:
    """InputError when `draft` cannot draft for `target`."""
    where = f"--draft {draft.folder}"
    if draft.folder.resolve() == target.folder.resolve():
        raise InputError(f"{where} is the target export itself; a draft is a smaller export of a model with the "
                         "same vocabulary (e.g. the target's int4 export)")
    if draft.vocab_size != target.vocab_size:
        raise InputError(f"{where}: its vocabulary has {draft.vocab_size} ids and the target's {target.vocab_size}; a "
                         "draft must share the target's vocabulary")
    if draft.tokenizer is None or target.tokenizer is None:
        raise InputError(f"{where}: the draft and the target both need their tokenizer.json to compare "
                         "vocabularies; re-export the one without it")
    _check_tokens(where, _vocabulary(draft), _vocabulary(target))
    if draft.eos_token_ids != target.eos_token_ids:
        raise InputError(f"{where}: its end-of-sequence ids {sorted(draft.eos_token_ids)} differ from the target's "
                         f"{sorted(target.eos_token_ids)}")
    if draft.manifest.get("vision") is not None:
        # A draft sees the row's tokens only (an image's placeholder ids among them), never its images: a
        # vision-language target drafts with a text export (plain positions: the target alone keeps the rows'
        # M-RoPE positions and rope_deltas, and verifies every drafted token at them).
        raise InputError(f"{where}: a draft drafts from tokens alone and takes no images; export the draft model "
                         "with --text-only")


def _vocabulary(export: LoadedExport) -> tuple[dict[str, int], dict[int, str]]:
    """The tokenizer's token -> id map and its special (added) tokens by id."""
    data: dict[str, Any] = json.loads(export.tokenizer.to_json())
    vocab = (data.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
        vocab = {piece[0]: i for i, piece in enumerate(vocab)}
    added = {int(t["id"]): str(t["content"]) for t in data.get("added_tokens") or ()}
    return vocab, added


def _check_tokens(where: str, draft: tuple[dict[str, int], dict[int, str]],
                  target: tuple[dict[str, int], dict[int, str]]) -> None:
    (draft_vocab, draft_added), (target_vocab, target_added) = draft, target
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: (item[1], item[0]))
        token, token_id = differing[0]
        raise InputError(f"{where}: its vocabulary differs from the target's ({len(differing)} token/id pairs, "
                         f"first {token!r} = {token_id}); a draft must share the target's token ids")
    if draft_added != target_added:
        ids = sorted(set(draft_added.items()) ^ set(target_added.items()))
        raise InputError(f"{where}: its special tokens differ from the target's (id {ids[0][0]}: "
                         f"{draft_added.get(ids[0][0])!r} vs {target_added.get(ids[0][0])!r})")
