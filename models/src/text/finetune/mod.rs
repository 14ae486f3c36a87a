//! Fine-tuning data as people bring it: rows of plain text, of conversations (`messages`)
//! or of prompt/completion pairs ([`rows`]), conversations rendered through the
//! tokenizer's chat template ([`template`]), which tokens the loss is on ([`masks`]): the
//! assistant's, the completion's, or all; and the token file of sequences they make
//! ([`tokenize`]).

pub mod masks;
pub mod rows;
pub mod template;
pub mod tokenize;

pub use masks::{LossOn, Sample, encode_row};
pub use rows::{Format, Part, Row, is_rows_file, read_rows};
pub use template::{ChatTemplate, Rendered};
pub use tokenize::{RowsInput, RowsSummary, write_rows_token_file};

#[cfg(test)]
mod fixture_tests;
