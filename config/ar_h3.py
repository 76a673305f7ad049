"""H3's associative-recall recipe as published, with Hedgehog App. B.1's sizes: python train_ar.py config/ar_h3.py

Sources (HazyResearch/safari): src/dataloaders/synthetics.py (the data), configs/dataset/icl_synthetics.yaml,
configs/experiment/synthetics/associative_recall/base.yaml (optimiser, schedule, 400 epochs) and
transformer.yaml (the model). Hedgehog App. B.1: 40 tokens, 128-token sequences, 10,000 training and
2,000 test sequences, early stopping once the validation loss has not decreased for 10 epochs.
Differences that remain: our blocks are pre-norm; attention dropout acts on softmax's weights only,
since linear attention never forms them; early stopping watches the loss on the first 500 test
sequences (the answer's cross-entropy) and starts counting after the warm-up (H3's code has no early
stopping, Hedgehog's schedule is not given).
Width: the published model is 32 wide, for H3's 20 tokens and 40-token sequences. At Hedgehog's sizes
softmax at that width stays on the plateau through all 400 epochs; --d_model=64 (the width of H3's Hyena
configs for this task) learns it (docs/results.md).
"""
format = "h3"  # k v ... => q v; every next token labelled in training, only the last in test; unique examples
vocab_size = 40  # with H3's two special tokens: 19 keys, 19 values, "=>", and a no-op never drawn
seq_len = 128  # input_seq_len: 64 pairs, then => q v (130 input positions, learned position embeddings)
num_train = 10_000
num_test = 2_000
n_layer = 2
d_model = 32
n_head = 1
features = "0"  # q and k of every map 32 wide, as in the published model: F follows from the map
mlp_ratio = 4  # d_inner = 4 d_model
token_shift = False
dropout = 0.1  # embed_dropout 0.1 and attention dropout 0.1 (resid_dropout 0)
lr = 5e-4
weight_decay = 0.1
batch_size = 32
warmup = 0.1  # linear warm-up over the first 10% of steps, then linear decay
epochs = 400
patience = 10
target_acc = 1.01  # no stop at a target: early stopping as in Hedgehog App. B.1
eval_every = 313  # about once an epoch
