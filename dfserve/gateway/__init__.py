"""The online A/B split: routes live OpenAI/SGLang traffic between drafter arms and measures each arm."""
