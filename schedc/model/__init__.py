"""GPT-2: shapes by arithmetic (torch-free), the torch model, data, and the reference step."""
