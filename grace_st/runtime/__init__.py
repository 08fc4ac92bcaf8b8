"""How any method's model is fed: the shared batch records, decoding, the second pass, vLLM, weights. It
knows no method: the methods (``grace_st.methods``) call it."""
