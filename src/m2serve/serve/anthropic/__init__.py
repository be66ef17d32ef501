"""The Anthropic Messages API (issue 19 item 2): a router and its wire types on the chat pipeline."""
