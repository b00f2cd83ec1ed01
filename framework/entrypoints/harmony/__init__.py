"""gpt-oss's harmony chat format through openai-harmony: the vocabulary found offline (`vocab`), OpenAI messages
rendered into a harmony prompt (`render`), the output read by channel (`output`), the forced-call grammar
(`grammar`), and the format as a chat request uses it (`chat`). docs/tool_calling.md describes it."""
