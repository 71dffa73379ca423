"""--reward-model: an AutoModelForSequenceClassification that scores whole conversations in place
of a reward function (a feature: loaded only where the flag asks for it).
"""

import torch

from common.data import pad
from common.errors import UsageError
from common.model import check_packs, pack_inputs, packs_batch, register_varlen


class RewardModel:
    """An AutoModelForSequenceClassification scoring whole conversations (one logit each).

    With the policy's tokenizer and chat template, the sampled token ids are scored as they are;
    otherwise each conversation is decoded to text and re-rendered with the reward model's own
    chat template and tokenizer (verl's return_raw_input_ids case).
    """

    def __init__(
        self,
        path: str,
        policy_tokenizer,
        device,
        trust_remote_code: bool = False,
        batch_size: int = 64,
        remove_padding: bool | str = False,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device, self.batch_size = device, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path,
            trust_remote_code=trust_remote_code,
            **({"attn_implementation": register_varlen()} if remove_padding else {}),
        )
        if remove_padding and not hasattr(self.model, "score"):  # transformers' causal-LM classifiers' head
            if remove_padding is True:
                raise UsageError(
                    f"--use-remove-padding: reward model {path} ({type(self.model).__name__}) has no "
                    f"`score` head to apply to packed sequences; set --use-remove-padding False"
                )
            self.model.set_attn_implementation("sdpa")
            remove_padding = False
        check_packs(self.model, path, remove_padding)
        self.model.to(device).eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.same_tokens = (
            self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
            and self.tokenizer.chat_template == policy_tokenizer.chat_template
        )

    def inputs(self, messages: list[list[dict]], responses: list[str], prompt_ids, response_ids) -> list[list[int]]:
        if self.same_tokens:
            return [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        texts = [
            self.tokenizer.apply_chat_template(m + [{"role": "assistant", "content": r}], tokenize=False)
            for m, r in zip(messages, responses)
        ]
        return [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]

    def score(self, messages, responses, prompt_ids, response_ids):
        ids = self.inputs(messages, responses, prompt_ids, response_ids)
        out = []
        with torch.no_grad():
            for start in range(0, len(ids), self.batch_size):
                chunk = ids[start : start + self.batch_size]
                input_ids = pad(chunk, self.model.config.pad_token_id).to(self.device)
                attention = pad([[1] * len(x) for x in chunk], 0).to(self.device)
                out.append(self._scores(input_ids, attention))
        return torch.cat(out)

    def _scores(self, input_ids, attention) -> torch.Tensor:
        """One logit per right-padded row, read where transformers' classifier reads it: at the row's
        last token that is not the pad token (a packed batch reads the same token of each sequence)."""
        if not packs_batch(self.model, attention.sum(), attention.numel()):
            return self.model(input_ids=input_ids, attention_mask=attention).logits[:, 0].float()
        inputs, starts = pack_inputs(input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0))
        kept = (input_ids != self.model.config.pad_token_id) & attention.bool()
        last = (torch.arange(input_ids.shape[1], device=input_ids.device) * kept).argmax(-1)
        hidden = self.model.base_model(**inputs).last_hidden_state[0]
        return self.model.score(hidden[starts[:-1] + last])[:, 0].float()
