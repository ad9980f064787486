"""The model's components: each describes its tensors once (`TensorSpec`s) and provides its
function. Norms (`norms`), positions (`positions`), the attention mixer (`attention`) and MLPs
(`mlp`) are chosen by the model config; `ops` holds the shared numerics."""
