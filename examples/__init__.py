"""Example clients of trainer-refit, written the way a user would write theirs."""
