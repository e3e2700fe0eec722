"""Engine integrations: conversions between engines' paged KV layouts and kvtier's canonical layout."""
