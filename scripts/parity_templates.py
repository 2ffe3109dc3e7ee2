"""Chat templates and text of the parity fixtures (imported by make-parity-fixtures.py).

The templates are written for these fixtures in the style of the families they stand for (not
copied from any checkpoint): they use the Jinja features those families' real templates use
(`namespace`, `messages[::-1]`, `loop.index0`, string methods, `is string`, filters inside `+`
chains, whitespace control under trim_blocks/lstrip_blocks), so a renderer that gets one of
them wrong renders a different prompt than transformers does.
"""

# Llama-3 style: bos first, header tokens, `| trim` applied to the content inside a `+` chain.
LLAMA = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen2.5 style: a default system turn when the conversation has none.
QWEN2 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful quality inspector.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" and not message.tool_calls %}
        {{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The Qwen3 body shared by the qwen3 and qwen3_vl templates: the last real user query is found
# by walking the conversation backwards; assistant turns after it keep their reasoning, earlier
# ones lose it; `enable_thinking=false` opens the answer with an empty think block.
_QWEN3_BODY = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
        and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = render_content(message.content) %}
    {%- endif %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

_QWEN3_SYSTEM = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].content is string %}
        {{- messages[0].content }}
    {%- else %}
        {{- render_content(messages[0].content) }}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
"""

# Qwen3: string content only (its render_content is never called on strings).
QWEN3 = (
    "{%- macro render_content(items) %}{%- for item in items %}{{- item.text }}{%- endfor %}"
    "{%- endmacro %}\n" + _QWEN3_SYSTEM + _QWEN3_BODY
)

# Qwen3-VL: content is a string or a list of text/image/video items; images and videos become
# vision placeholders, counted across the conversation (`add_vision_id` numbers them).
QWEN3_VL = (
    """{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(items) %}
    {%- for item in items %}
        {%- if item.type == 'image' or 'image' in item or 'image_url' in item %}
            {%- set image_count.value = image_count.value + 1 %}
            {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
            <|vision_start|><|image_pad|><|vision_end|>
        {%- elif item.type == 'video' or 'video' in item %}
            {%- set video_count.value = video_count.value + 1 %}
            {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
            <|vision_start|><|video_pad|><|vision_end|>
        {%- elif 'text' in item %}
            {{- item.text }}
        {%- endif %}
    {%- endfor %}
{%- endmacro %}
"""
    + _QWEN3_SYSTEM
    + _QWEN3_BODY
)

# Corpus of the tokenizer: English, Chinese QC-style text and the verdict contract strings.
CORPUS = [
    "Verdict: 通过\nReason: 玻璃边缘密封胶连续，无气泡，无缺口。",
    "Verdict: 不通过\nReason: 焊缝有裂纹，长度约 3 mm，位于左侧 B 柱。",
    "Verdict: 通过\nReason: all four bolts torqued to 45 N·m, paint marks aligned.",
    "Verdict: 不通过\nReason: label missing at position 2; sealant bead broken.",
    "Reason: 漆面无流挂、无橘皮，色差 ΔE < 1.0，符合标准。",
    "Reason: 线束卡扣未完全卡入，存在松动风险，需要返工。",
    "Reason: the gap between door and fender is 4.5 mm, within tolerance (4.0–5.0 mm).",
    "挡风玻璃安装检查：检查玻璃四周密封条是否贴合，胶条是否连续，有无漏涂。",
    "质量检验员根据照片和检验记录判断该工位是否合格，并给出一行理由。",
    "焊点检查：焊点数量、位置、直径均需符合工艺卡要求，虚焊和漏焊为不合格。",
    "螺栓拧紧力矩检查：使用扭力扳手复核，力矩值应在规定范围内并做标记。",
    "涂装检查：目视检查漆面，不得有颗粒、流挂、缩孔、划伤等缺陷。",
    "You are a strict quality inspector. Answer with a verdict and one line of reason.",
    "The inspector checks the windshield installation: the urethane bead must be continuous.",
    "Ticket QC-17: rear lamp housing, photo 3 of 5, gasket seated, no visible gap.",
    "Ticket QC-42: 后视镜支架螺丝缺失一颗，判定为不合格。",
    "Summary: 检验项目 12 项，合格 11 项，不合格 1 项（标签位置偏移）。",
    "If any item fails, the verdict is 不通过; otherwise the verdict is 通过.",
    "请根据以下检验记录给出结论。格式：Verdict: 通过 或 Verdict: 不通过，然后 Reason: 一行。",
    "Measurements: 12.5 mm, 13.0 mm, 12.8 mm; mean 12.77 mm; limit 12.0-13.5 mm.",
    "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000, dates 2024-05-21, times 08:30:00.",
    "Punctuation: ,.;:!?()[]{}<>\"'`~@#$%^&*-_=+/\\| and 全角标点，。；：！？（）【】《》“”‘’",
    "门板内饰检查：卡扣齐全，无异响；密封条无褶皱；玻璃升降顺畅。",
    "Engine bay: hoses clamped, no oil leak, coolant at MAX line, connectors locked.",
    "底盘检查：制动管路固定可靠，无干涉，无渗漏；排气管吊耳安装到位。",
]

# The fixed string whose tokenization is compared: CJK, full-width punctuation, digits, a
# newline, an emoji and an accented letter absent from the corpus (raw byte tokens), and a
# special token written in the text (matched as one token).
TOKENIZE_TEXT = (
    "Verdict: 不通过\nReason: 焊缝长 3.5 mm，超出 ±0.5 mm 🚗 café<|im_end|>  tail"
)

SYSTEM = "你是一名严格的质检员 (strict QC inspector)。只回答 Verdict 和一行 Reason。"
USER = (
    "检验记录：挡风玻璃 sealant bead continuous, 无气泡；标签 visible at 3 positions。"
    "请判断是否通过。"
)

# The long prompt (~200 tokens with the fixture tokenizer), mixed Chinese and English.
LONG_TEXT = (
    "Ticket QC-2024-0521, station 7 (windshield install). 检验员记录如下：\n"
    "1. 玻璃四周 urethane bead 连续，宽度 8–10 mm，无断胶；\n"
    "2. 上部两个定位销 seated, 左下角 gap 1.2 mm (limit 1.5 mm)；\n"
    "3. 雨量传感器 bracket 粘接牢固，connector locked；\n"
    "4. 标签 label at positions 1, 2, 3 visible, position 4 partly covered by trim.\n"
    "Photos: 5 of 5 attached. 之前同一工位的 ticket QC-17 判定为通过，QC-42 判定为不通过"
    "（后视镜支架螺丝缺失）。Please decide: Verdict 通过 or 不通过, one line of Reason, "
    "in Chinese. 注意：any missing fastener is an automatic 不通过."
)
