//! Jain's fairness index, the figure the fairness tests and the layer's gauge report.

/// Jain's fairness index `(Σx)² / (n·Σx²)`: 1.0 when all values are equal,
/// `1/n` when one of `n` gets everything. `None` for no values, all zeros,
/// or a non-finite result.
pub fn jain_index(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (mut n, mut sum, mut squares) = (0.0_f64, 0.0_f64, 0.0_f64);
    for x in values {
        n += 1.0;
        sum += x;
        squares += x * x;
    }
    if n == 0.0 || squares == 0.0 {
        return None;
    }
    let index = sum * sum / (n * squares);
    index.is_finite().then_some(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jain_index_equal_values_is_one() {
        let j = jain_index([3.0; 5]).expect("values");
        assert!((j - 1.0).abs() < 1e-12);
    }

    #[test]
    fn jain_index_one_of_n_is_one_over_n() {
        let j = jain_index([7.0, 0.0, 0.0, 0.0]).expect("values");
        assert!((j - 0.25).abs() < 1e-12);
    }

    #[test]
    fn jain_index_empty_or_all_zero_is_none() {
        assert_eq!(jain_index(std::iter::empty()), None);
        assert_eq!(jain_index([0.0, 0.0]), None);
    }
}
