//! Which modules a [`LoraConfig`] adapts, and with what rank and scaling: PEFT's matching
//! rules (`check_target_module_exists`, `get_pattern_key`), checked against a model's
//! modules.

use regex::Regex;
use serde_json::{Value, json};

use super::config::{AdapterSpec, LoraConfig};

/// Which modules get an adapter (`target_modules`) or are left without one
/// (`exclude_modules`), as PEFT matches them against a module's path.
#[derive(Debug, Clone)]
pub enum Targets {
    /// A list of names: a module whose path equals one or ends in `.name`.
    Names(Vec<String>),
    /// A regular expression the whole path must match (its source kept for writing back).
    Pattern(String, Regex),
    /// `"all-linear"`: every linear layer but the output head.
    AllLinear,
}

impl Targets {
    /// Whether the module at `path` (a linear layer when `linear`; `head` when it is the
    /// model's output head) is named.
    fn names(&self, path: &str, linear: bool, head: bool) -> bool {
        match self {
            Self::Names(names) => names.iter().any(|n| ends_with_name(path, n)),
            Self::Pattern(_, re) => re.is_match(path),
            Self::AllLinear => linear && !head,
        }
    }

    pub(super) fn to_json(&self) -> Value {
        match self {
            Self::Names(names) => json!(names),
            Self::Pattern(source, _) => json!(source),
            Self::AllLinear => json!("all-linear"),
        }
    }
}

/// Whether `path` is module `name` or inside it, `name` being whole dotted parts of it
/// (PEFT's rule keeping adapters off `modules_to_save`).
fn contains_module(path: &str, name: &str) -> bool {
    let (path, name) = (format!(".{path}."), format!(".{name}."));
    path.contains(&name)
}

/// The module paths above the parameter at `param`, outermost first (`a.b.weight` gives
/// `a` and `a.b`).
fn modules_of(param: &str) -> impl Iterator<Item = &str> {
    param.match_indices('.').map(|(dot, _)| &param[..dot])
}

/// Every module path above the parameters at `params` (`a.b.weight` gives `a` and `a.b`),
/// sorted: the modules [`LoraConfig::check_against`] checks `modules_to_save` against.
pub fn modules_above<'a>(params: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let modules: std::collections::BTreeSet<&str> = params.into_iter().flat_map(modules_of).collect();
    modules.into_iter().map(str::to_string).collect()
}

/// Whether `path` equals `name` or ends in `.name` (PEFT's rule for a list of names).
fn ends_with_name(path: &str, name: &str) -> bool {
    path == name || path.strip_suffix(name).is_some_and(|head| head.ends_with('.'))
}

/// The one pattern of `regexes` (a `rank_pattern` or `alpha_pattern`, named `key`) that
/// names `path`, if any; an error where two do (PEFT would take the first in its file's
/// order, which JSON does not keep).
fn pattern_hit<'a>(regexes: &'a [(String, Regex)], path: &str, key: &str) -> Result<Option<&'a String>, String> {
    let mut hits = regexes.iter().filter(|(_, re)| re.is_match(path)).map(|(p, _)| p);
    match (hits.next(), hits.next()) {
        (Some(a), Some(b)) => {
            Err(format!("{key}: both {a:?} and {b:?} match module `{path}`; make one pattern name it"))
        }
        (one, _) => Ok(one),
    }
}

impl LoraConfig {
    /// The adapter of the module at `path`, if it gets one: `linear` says whether it is a
    /// linear layer (only those are adapted), `head` whether it is the output head (left
    /// out by `"all-linear"`), `defaults` the family's targets where `target_modules` is not
    /// set. An error where two `rank_pattern` (or `alpha_pattern`) entries name the module
    /// (PEFT would take the first in its file's order, which JSON does not keep).
    pub fn adapter(
        &self,
        path: &str,
        linear: bool,
        head: bool,
        defaults: &[&str],
    ) -> Result<Option<AdapterSpec>, String> {
        let named = match &self.target_modules {
            Some(targets) => targets.names(path, linear, head),
            None => defaults.iter().any(|n| ends_with_name(path, n)),
        };
        let saved = self.modules_to_save.iter().any(|m| contains_module(path, m));
        if !named || !linear || saved || self.excluded(path, linear, head) || !self.in_layers(path) {
            return Ok(None);
        }
        let r = pattern_hit(&self.rank_regex, path, "rank_pattern")?.map_or(self.r, |p| self.rank_pattern[p]);
        let alpha =
            pattern_hit(&self.alpha_regex, path, "alpha_pattern")?.map_or(self.lora_alpha, |p| self.alpha_pattern[p]);
        let scaling = self.scaled(alpha, r);
        Ok(Some(AdapterSpec { r, alpha, scaling, dropout: self.lora_dropout, init: self.init_lora_weights }))
    }

    /// The scaling of an adapter of rank `r` on the module at `path`: its `alpha_pattern`
    /// entry or `lora_alpha`, over `r` (its root with rslora); the rank is the adapter's own
    /// (a trained one's factors say it).
    pub fn scaling_of(&self, path: &str, r: usize) -> Result<f64, String> {
        let alpha =
            pattern_hit(&self.alpha_regex, path, "alpha_pattern")?.map_or(self.lora_alpha, |p| self.alpha_pattern[p]);
        Ok(self.scaled(alpha, r))
    }

    /// `alpha / r`, or `alpha / sqrt(r)` with rslora.
    pub fn scaled(&self, alpha: f64, r: usize) -> f64 {
        if self.use_rslora { alpha / (r as f64).sqrt() } else { alpha / r as f64 }
    }

    /// Whether the module at `path` is trained whole (`modules_to_save`; PEFT's rule: the
    /// path ends in the name, dotted or not, so `norm` names `input_layernorm` too).
    pub fn saves(&self, path: &str) -> bool {
        self.modules_to_save.iter().any(|n| path.ends_with(n.as_str()))
    }

    /// Whether the parameter at `param` (a module path and the parameter's name) trains
    /// whole: some module above it is one [`saves`](Self::saves) names (PEFT wraps that
    /// module, and everything below it trains).
    pub fn trains_whole(&self, param: &str) -> bool {
        modules_of(param).any(|module| self.saves(module))
    }

    fn excluded(&self, path: &str, linear: bool, head: bool) -> bool {
        self.exclude_modules.as_ref().is_some_and(|t| t.names(path, linear, head))
    }

    /// Whether `path` is in one of `layers_to_transform` (PEFT's rule: the number after the
    /// first `.<pattern>.`, or after any dotted name where no pattern is given).
    fn in_layers(&self, path: &str) -> bool {
        let Some(layers) = &self.layers_to_transform else { return true };
        let parts: Vec<&str> = path.split('.').collect();
        let index = parts.windows(2).enumerate().find_map(|(i, w)| {
            // PEFT's expressions: the first number after a dotted name (which follows a dot
            // itself), or after one of the patterns, followed by a dot.
            let named = match &self.layers_pattern {
                None => i > 0,
                Some(patterns) => patterns.iter().any(|p| p == w[0]),
            };
            let digits = !w[1].is_empty() && w[1].bytes().all(|b| b.is_ascii_digit());
            (named && digits && i + 2 < parts.len()).then(|| w[1].parse::<usize>().ok()).flatten()
        });
        index.is_some_and(|i| layers.contains(&i))
    }

    /// Checks the targets against the model's modules: `linears` (path, whether it is the
    /// head) and `modules` (every module path). An error naming the pattern and a few paths
    /// that exist where `target_modules` adapts nothing, or a `modules_to_save` entry that
    /// names no module.
    pub fn check_against(
        &self,
        linears: &[(String, bool)],
        modules: &[String],
        defaults: &[&str],
    ) -> Result<(), String> {
        let mut adapted = 0;
        for (path, head) in linears {
            adapted += usize::from(self.adapter(path, true, *head, defaults)?.is_some());
        }
        if adapted == 0 {
            let asked = match &self.target_modules {
                Some(t) => t.to_json().to_string(),
                None => format!("{defaults:?} (the family's default)"),
            };
            let some: Vec<&str> = linears.iter().take(6).map(|(p, _)| p.as_str()).collect();
            return Err(format!(
                "target_modules {asked} matches none of the model's {} linear layers{}; they are named like {}",
                linears.len(),
                if self.layers_to_transform.is_some() || self.exclude_modules.is_some() {
                    " (after exclude_modules and layers_to_transform)"
                } else {
                    ""
                },
                some.join(", ")
            ));
        }
        for name in &self.modules_to_save {
            if !modules.iter().any(|m| m.ends_with(name.as_str())) {
                let tops: Vec<&str> = modules.iter().take(6).map(String::as_str).collect();
                return Err(format!(
                    "modules_to_save: {name:?} names no module of the model; its modules are named like {}",
                    tops.join(", ")
                ));
            }
        }
        Ok(())
    }
}
