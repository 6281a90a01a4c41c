"""bargein: an LLM inference engine where every generation can be stopped and continued exactly."""
