"""`LLM`: the offline, vLLM-compatible Python API — `generate` and `chat` over an `LLMEngine`."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence as SequenceType

from jaxserve.chat import render_chat, split_images
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine, PromptType
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, str]


class LLM:
    """`LLM(model=None, **engine_options)`: None loads the embedded default model (SmolLM2-135M-Instruct).

    Engine options are `EngineConfig`'s fields: tensor_parallel_size, max_num_seqs, max_model_len, page_size, num_kv_pages,
    gpu_memory_utilization, max_num_batched_tokens, enable_prefix_caching, dtype, seed,
    attention_backend, scheduling_policy, tokenizer, generation_config, enable_lora, max_loras, max_lora_rank,
    max_cpu_loras, ...
    """

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.llm_engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        """An LLM over an engine built from `config` (what `jaxserve.server.cli_args.engine_config` makes)."""
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: `SamplingParams()` with the model's generation_config.json defaults (unless
        `generation_config="vllm"`); what `generate` and `chat` use when given no sampling_params."""
        return SamplingParams(**self.llm_engine.default_sampling_params)

    def generate(self, prompts: PromptType | SequenceType[PromptType],
                 sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: SequenceType[int] | None = None,
                 lora_request: LoRARequest | SequenceType[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt (a string, token ids, or {"prompt_token_ids": [...]}); outputs in input order.
        `lora_request`: the adapter of every prompt, or a list with one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        # validate everything before queueing anything, so a bad prompt leaves the engine untouched
        request_ids = []
        pending = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            prepared = self.llm_engine.prepare(prompt)  # add_request will not tokenize or process images again
            self.llm_engine.validate_prompt(prepared["prompt_token_ids"], params)
            self.llm_engine.validate_priority(priority[index] if priority else 0)
            self.llm_engine.validate_guided_decoding(params)
            self.llm_engine.validate_lora(loras[index])
            final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            pending.append((prepared, final_only, priority[index] if priority else 0, loras[index]))
        for prompt, params, prio, lora in pending:
            request_ids.append(self.llm_engine.add_request(None, prompt, params, priority=prio, lora_request=lora))
        return self._run(request_ids, use_tqdm and len(prompts) > 4)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | SequenceType[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             lora_request: LoRARequest | SequenceType[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates (`lora_request`
        as for `generate`). Contents may be lists of parts, images among them as vLLM takes them (`{"type":
        "image_url", "image_url": {"url": ...}}` with a data:, file: or http(s) URL, `{"type": "image_pil",
        "image_pil": image}`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            conv, images = split_images(conv)
            prompt = {"prompt_token_ids": render_chat(self.llm_engine.tokenizer, conv, add_generation_prompt,
                                                      chat_template,
                                                      encode=self.llm_engine.encode_chat if images else None)}
            prompts.append({**prompt, "multi_modal_data": {"image": images}} if images else prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        """Prompt token ids of `messages` (image parts become the template's placeholders, unexpanded; see
        `chat`)."""
        return render_chat(self.llm_engine.tokenizer, split_images(messages)[0], add_generation_prompt,
                           chat_template)

    def reset_prefix_cache(self) -> bool:
        """Forgets the cached prefixes (vLLM's); False while requests are unfinished."""
        return self.llm_engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        progress = None
        if show_progress:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        wanted = set(request_ids)
        while len(results) < len(request_ids):
            for output in self.llm_engine.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [results[request_id] for request_id in request_ids]

