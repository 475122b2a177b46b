"""Fine-tuning BERT on the paper's downstream tasks: RACE (multiple choice), MNLI and QQP (sentence pairs),
SQuAD 1.1 / 2.0 (answer spans).

`race.py` and `glue.py` read the tasks' own file layouts into examples, `inputs.py` turns examples
into `[CLS] A [SEP] B [SEP]` arrays, `heads.py` puts a multiple-choice or classification head on
the pretrained encoder, `loop.py` trains, evaluates and predicts under tensor x data parallelism,
`saved.py` keeps the fine-tuned model as one file and loads it back at any TP size,
`predictions.py` writes the prediction files of dev and test sets, and `cli.py` is
`shardlm finetune race|mnli|qqp|squad`. SQuAD has its own reader (`squad_data.py`), windows
(`squad_features.py`), span head (`heads.SpanModel`), decoding (`squad_decode.py`), official metrics
(`squad_metrics.py`) and command-line glue (`squad.py`), and shares the loop, saving and launching.
"""
