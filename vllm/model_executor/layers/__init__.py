"""Building blocks shared by every model: linear (fused slices), RMSNorm, rotary
embedding, vocabulary embedding and LM head."""
