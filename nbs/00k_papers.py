# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: python3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # papers
#
# > The papers' published numbers: the one place they are kept, always labelled as the paper's.

# %%
#| default_exp papers

# %%
#| export
from __future__ import annotations
import pandas as pd

# %% [markdown]
# Every number in this module is copied from a paper's table (the full texts are in `shared/papers/`), with the
# paper's own markers kept in `note`. capbook's tables put these rows beside capbook's measured rows and label them
# `source = "paper (quoted)"`; nothing here is ever computed or compared as if it were capbook's.
#
# ## Show, Attend and Tell (Xu et al. 2015), Table 1
# "BLEU-1,2,3,4/METEOR metrics compared to other methods, † indicates a different split, (—) indicates an unknown
# metric, ◦ indicates the authors kindly provided missing metrics by personal communication, Σ indicates an ensemble,
# a indicates using AlexNet". BLEU is reported without a brevity penalty (§5.2). `None` is the paper's "—".

# %%
#| export
_SAT_T1 = """dataset|model|BLEU-1|BLEU-2|BLEU-3|BLEU-4|METEOR|note
Flickr8k|Google NIC|63|41|27|||† Σ
Flickr8k|Log Bilinear|65.6|42.4|27.7|17.7|17.31|◦
Flickr8k|Soft-Attention|67|44.8|29.9|19.5|18.93|
Flickr8k|Hard-Attention|67|45.7|31.4|21.3|20.30|
Flickr30k|Google NIC|66.3|42.3|27.7|18.3||† ◦ Σ
Flickr30k|Log Bilinear|60.0|38|25.4|17.1|16.88|
Flickr30k|Soft-Attention|66.7|43.4|28.8|19.1|18.49|
Flickr30k|Hard-Attention|66.9|43.9|29.6|19.9|18.46|
COCO|CMU/MS Research|||||20.41|a
COCO|MS Research|||||20.71|† a
COCO|BRNN|64.2|45.1|30.4|20.3||◦
COCO|Google NIC|66.6|46.1|32.9|24.6||† ◦ Σ
COCO|Log Bilinear|70.8|48.9|34.4|24.3|20.03|◦
COCO|Soft-Attention|70.7|49.2|34.4|24.3|23.90|
COCO|Hard-Attention|71.8|50.4|35.7|25.0|23.04|"""

def _parse(table: str) -> pd.DataFrame:
    rows = [l.split("|") for l in table.strip().splitlines()]
    df = pd.DataFrame(rows[1:], columns=rows[0]).replace("", None)
    for c in df.columns:
        if c not in ("dataset", "model", "note"): df[c] = pd.to_numeric(df[c])
    return df

def sat_table1() -> pd.DataFrame:
    "Show-Attend-Tell Table 1 as published (BLEU-1..4, METEOR, ×100)."
    return _parse(_SAT_T1).assign(source="paper (quoted)")


# %%
_t = sat_table1()
assert len(_t) == 15 and _t.query("dataset == 'COCO' and model == 'Soft-Attention'")["BLEU-4"].item() == 24.3
_t.tail(2)
