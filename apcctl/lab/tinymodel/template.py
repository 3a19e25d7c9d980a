"""The chat templates the tiny models ship, kept as Jinja files in ``data/``.

``CHAT_TEMPLATE`` (``data/chat_template.jinja``) is GLM-4.5's template (zai-org/GLM-4.5, as
apcctl/templates/glm45.jinja holds it), shortened: the tools block is its own <|system|> turn
before the system text; an assistant turn is "\\n<think>reasoning</think>" only after the last
user message and "\\n<think></think>" otherwise, then "\\n" + content.strip(); the generation
prompt is "<|assistant|>", plus "\\n<think></think>" with enable_thinking=false (mlx-vlm's server
default). So a reply without reasoning, re-sent as ``content``, re-renders verbatim: the next
prompt starts with this prompt + the generated tokens (whitespace is not a token here). Left
out: GLM-4.5's "/nothink" suffix on user turns. Tool calls are
<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call> (one per line); tool
results <|observation|><tool_response>...</tool_response>.

``CHATML_TEMPLATE`` (``data/chatml_template.jinja``) is the ChatML of the ``servable`` families:
system/user/assistant turns, images as ``<|vision_start|><|image_pad|><|vision_end|>``.
"""

from __future__ import annotations

from apcctl.lab.tinymodel.datafiles import read_data


def read_template(name: str) -> str:
    """A template file's text without the final newline the file ends with (the template has none:
    it is written verbatim into every model directory and tokenizer_config.json)."""
    return read_data(name).removesuffix("\n")


CHAT_TEMPLATE: str = read_template("chat_template.jinja")
CHATML_TEMPLATE: str = read_template("chatml_template.jinja")
