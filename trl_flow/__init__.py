"""trl_flow."""
