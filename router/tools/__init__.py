"""Tool calling in the router: request checks, the constraint per tool_choice, and the output parsers."""
