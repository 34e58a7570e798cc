"""The chat templates of the vision-language families kvforge exports whole (models/vision_families.py), as their
released Hugging Face checkpoints carry them, with where each text was taken from. Test fixtures of
tests/runtime/test_vision_chat_templates.py: each renders a conversation with image parts the way transformers' processor
does, and kvforge must give the same token ids."""

from __future__ import annotations

# LLaVA-1.5 (llava-hf/llava-1.5-7b-hf's chat_template.json): every image of a message first, then its text parts, each
# followed by a space; `{% generation %}` marks the assistant's text. Text taken from PKU-Alignment/align-anything
# (align_anything/models/gemma3.py), which carries llava-hf's template verbatim. Also the "LLaVA-1.5-style" template
# of issue 53 (the question dropped when content reaches it as one string).
LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# ViP-LLaVA (llava-hf/vip-llava-7b-hf): "###Human: <image>\n...###Assistant:". Text taken from public code that
# passes the checkpoint's template (found by the search tool's find_string, the repository unnamed there; the same text
# with its "{{SYSTEM_PROMPT}}###Human: <image>\n{{PROMPT}}###Assistant:" comment in another).
VIPLLAVA = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'][0]['text'] }}"
    "{% elif message['role'] == 'user' %}{{ '###Human: '}}{% else %}{{ '###' + message['role'].title() + ': '}}"
    "{% endif %}{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ '###Assistant:' }}{% endif %}"
)

# Video-LLaVA (LanguageBind/Video-LLaVA-7B-hf): LLaVA-1.5's "USER: ... ASSISTANT:" form with videos after images.
# Not found verbatim in the searchable corpora: written from the model card's prompt format ("USER: <image>\n...
# ASSISTANT:") in the form llava-hf's templates take (images, then videos, then text parts).
VIDEO_LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\n' }}{% endfor %}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# InternVL (OpenGVLab/InternVL3-1B-hf): ChatML, "<IMG_CONTEXT>\n" per image part. Text taken from transformers'
# src/transformers/models/internvl/convert_internvl_weights_to_hf.py (the `chat_template` it saves with the processor).
INTERNVL = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)

# GOT-OCR2 (stepfun-ai/GOT-OCR-2.0-hf): ChatML with the processor's "<img><imgpad></img>" image block (its processor
# expands "<imgpad>"). Not found verbatim in the searchable corpora: written from the checkpoint's documented prompt
# ("<|im_start|>user\n<img><imgpad>...</img>\nOCR: <|im_end|><|im_start|>assistant\n") in InternVL's ChatML form.
GOT_OCR2 = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<img><imgpad></img>\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{'<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)

# Aya Vision (CohereLabs/aya-vision-8b): Cohere's turn tokens, "<image>" per image part in the order of the parts.
# Not found verbatim in the searchable corpora (the released template also writes a long default preamble): this is
# its message loop, as the model card's examples render it.
AYA_VISION = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' }}{% elif message['role'] == 'assistant' %}"
    "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% else %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' }}"
    "{% endif %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|END_OF_TURN_TOKEN|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{% endif %}"
)

# DeepSeek-VL (deepseek-community/deepseek-vl-1.3b-chat): "User: ...\n\nAssistant:", "<image_placeholder>" per image.
# Text taken from transformers' tests/models/deepseek_vl/test_processing_deepseek_vl.py (prepare_processor_dict).
DEEPSEEK_VL = (
    "{% set seps = ['\n\n', '<\uff5cend\u2581of\u2581sentence\uff5c>'] %}{% set i = 0 %}You are a helpful language and "
    "vision assistant. You are able to understand the visual content that the user provides, and assist the user with "
    "a variety of tasks using natural language.\n\n{% for message in messages %}"
    "{% if message['role']|lower == 'user' %}User: {% elif message['role']|lower == 'assistant' %}Assistant:"
    "{% if not (loop.last and not add_generation_prompt and message['content'][0]['type']=='text' and "
    "message['content'][0]['text']=='') %} {% endif %}{% else %}{{ message['role'].capitalize() }}: {% endif %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<image_placeholder>"
    "{% elif content['type'] == 'text' %}{% set text = content['text'] %}{% if loop.first %}"
    "{% set text = text.lstrip() %}{% endif %}{% if loop.last %}{% set text = text.rstrip() %}{% endif %}"
    "{% if not loop.first and message['content'][loop.index0-1]['type'] == 'text' %}{{ ' ' + text }}{% else %}"
    "{{ text }}{% endif %}{% endif %}{% endfor %}{% if not loop.last or add_generation_prompt %}"
    "{% if message['role']|lower == 'user' %}{{ seps[0] }}{% else %}{{ seps[1] }}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Janus (deepseek-community/Janus-Pro-1B): "<|User|>: ...\n\n<|Assistant|>:", "<image_placeholder>" per image. Text
# taken from transformers' src/transformers/models/janus/convert_janus_weights_to_hf.py (CHAT_TEMPLATE).
JANUS = (
    "{%set seps=['\n\n','<\uff5cend\u2581of\u2581sentence\uff5c>']%}{%set i=0%}{%for message in messages%}"
    "{%if message['role']|lower=='user'%}<|User|>: {%elif message['role']|lower=='assistant'%}<|Assistant|>:"
    "{%if not (loop.last and not add_generation_prompt and message['content'][0]['type']=='text' and "
    "message['content'][0]['text']=='')%} {%endif%}{%else%}{{message['role'].capitalize()}}: {%endif%}"
    "{%for content in message['content']%}{%if content['type']=='image'%}{%if not loop.first%}{{'\n'}}{%endif%}"
    "<image_placeholder>{%if not loop.last%}{{'\n'}}{%endif%}{%elif content['type']=='text'%}"
    "{%set text=content['text']%}{%if loop.first%}{%set text=text.lstrip()%}{%endif%}{%if loop.last%}"
    "{%set text=text.rstrip()%}{%endif%}{%if not loop.first and message['content'][loop.index0-1]['type']=='text'%}"
    "{{' '+text}}{%else%}{{text}}{%endif%}{%endif%}{%endfor%}{%if not loop.last or add_generation_prompt%}"
    "{%if message['role']|lower=='user'%}{{seps[0]}}{%else%}{{seps[1]}}{%endif%}{%endif%}{%endfor%}"
    "{%if add_generation_prompt%}<|Assistant|>:{%endif%}"
)

RELEASED_TEMPLATES = {"llava": LLAVA, "vipllava": VIPLLAVA, "video_llava": VIDEO_LLAVA, "internvl": INTERNVL,
                      "got_ocr2": GOT_OCR2, "aya_vision": AYA_VISION, "deepseek_vl": DEEPSEEK_VL, "janus": JANUS}
