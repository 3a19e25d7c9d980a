"""Modal screens: confirmations, the anchor file prompt, help."""
